"""Hugging Face GraniteMoeForCausalLM trained through ``labels``: a mixture of experts whose expert
weights are two stacked ``ParallelExperts`` modules (``input_linear``: experts x 2·ffn x hidden for the
gate and up halves, ``output_linear``: experts x hidden x ffn) called with per-expert token counts after
a sort by expert, a top-k ``TopKGating`` router, and muP-style multipliers (embedding, residual,
attention scale, logits scaling).

Full size: Granite-3.0-3B-A800M (32 layers, hidden 1536, 24 heads / 8 KV heads of 64, 40 experts of
FFN 512 with top 8, vocab 49155, 4096 tokens).
"""

import torch
from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, vocab_size=256,
                 max_position_embeddings=64, embedding_multiplier=12.0, logits_scaling=6.0,
                 residual_multiplier=0.22, attention_multiplier=0.0625),
    "full": dict(num_hidden_layers=32, hidden_size=1536, num_attention_heads=24, num_key_value_heads=8,
                 intermediate_size=512, num_local_experts=40, num_experts_per_tok=8, vocab_size=49155,
                 max_position_embeddings=4096, embedding_multiplier=12.0, logits_scaling=6.0,
                 residual_multiplier=0.22, attention_multiplier=0.015625),
}
SIZE = "tiny"
CONFIG = GraniteMoeConfig(**SIZES[SIZE], attention_dropout=0.0, use_cache=False, tie_word_embeddings=True)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return GraniteMoeForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
