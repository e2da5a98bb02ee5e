"""Hugging Face OPTForCausalLM: learned positions with an offset, post-attention projections named
``fc1``/``fc2`` directly in the block, and an attention that views its projections as
``(b, -1, num_heads, head_dim)`` (a tp shard must divide ``num_heads``, or the heads fold into the
sequence). Dict of ``input_ids`` and ``labels``, ``output.loss``.

Full size: OPT-6.7B (32 layers, hidden 4096, 32 heads, FFN 16384, vocab 50272, 2048 tokens).
"""

import torch
from transformers import OPTConfig, OPTForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, ffn_dim=256, num_attention_heads=4, vocab_size=256,
                 max_position_embeddings=32, word_embed_proj_dim=64),
    "full": dict(num_hidden_layers=32, hidden_size=4096, ffn_dim=16384, num_attention_heads=32, vocab_size=50272,
                 max_position_embeddings=2048, word_embed_proj_dim=4096),
}
SIZE = "tiny"
CONFIG = OPTConfig(**SIZES[SIZE], use_cache=False, dropout=0.0, attention_dropout=0.0)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return OPTForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
