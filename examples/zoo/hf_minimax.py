"""Hugging Face MiniMaxForCausalLM (MiniMax-Text-01's hybrid), trained through labels.

Seven lightning-attention layers (linear attention with a per-head decay, computed block by block
over the sequence in plain torch) to one softmax-attention layer, a top-2 MoE in every layer, and
each residual scaled by its own alpha / beta factors.

Full size: MiniMax-Text-01's layer shape at 16 of its 80 layers (hidden 6144, 64 heads over 8 KV
heads of 128, 32 experts of FFN 9216, vocab 200064): 93 B parameters.
"""

import torch
from transformers import MiniMaxConfig, MiniMaxForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=8, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=4, vocab_size=256, block_size=16),
    "full": dict(num_hidden_layers=16, hidden_size=6144, intermediate_size=9216, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, num_local_experts=32, vocab_size=200064, block_size=256),
}
SIZE = "tiny"
_N = SIZES[SIZE]["num_hidden_layers"]
CONFIG = MiniMaxConfig(**SIZES[SIZE], num_experts_per_tok=2, router_jitter_noise=0.0, attention_dropout=0.0,
                       layer_types=["full_attention" if (i + 1) % 8 == 0 else "linear_attention" for i in range(_N)],
                       use_cache=False)
SEQ_LEN = 4096 if SIZE == "full" else 64


def build_model():
    return MiniMaxForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
