"""Hugging Face PhimoeForCausalLM (Phi-3.5-MoE), trained through labels.

Sixteen experts, top-2 chosen by SparseMixer (the second expert picked with the first masked out,
each weight from its own masked softmax), LayerNorm with biases, biased attention projections, an
untied head with a bias.

Full size: Phi-3.5-MoE (32 layers, hidden 4096, 32 heads over 8 KV heads, 16 experts of FFN 6400,
vocab 32064).
"""

import torch
from transformers import PhimoeConfig, PhimoeForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, vocab_size=256),
    "full": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=6400, num_attention_heads=32,
                 num_key_value_heads=8, num_local_experts=16, vocab_size=32064),
}
SIZE = "tiny"
CONFIG = PhimoeConfig(**SIZES[SIZE], num_experts_per_tok=2, router_jitter_noise=0.0, input_jitter_noise=0.0,
                      attention_dropout=0.0, use_cache=False)
SEQ_LEN = 4096 if SIZE == "full" else 64


def build_model():
    return PhimoeForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
