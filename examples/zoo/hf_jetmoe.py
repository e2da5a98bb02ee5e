"""Hugging Face JetMoeForCausalLM trained through ``labels``: mixture of experts in the attention as
well as the MLP -- every block routes each token top-2 among 8 attention experts (their own query and
output projections, one shared key/value projection) and top-2 among 8 MLP experts, each mixture a
router plus stacked expert weights (``ParallelExperts``) called with per-expert token counts; every
layer is a MoE layer.

Full size: JetMoE-8B (24 layers, hidden 2048, 8 experts top-2, 16 KV heads of 128, MLP 5632,
vocab 32000, 4096 tokens).
"""

import torch
from transformers import JetMoeConfig, JetMoeForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, num_key_value_heads=4, kv_channels=16,
                 intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                 max_position_embeddings=64),
    "full": dict(num_hidden_layers=24, hidden_size=2048, num_key_value_heads=16, kv_channels=128,
                 intermediate_size=5632, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                 max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = JetMoeConfig(**SIZES[SIZE], attention_dropout=0.0, use_cache=False)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return JetMoeForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
