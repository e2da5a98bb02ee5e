"""Hugging Face JambaForCausalLM: a hybrid of Mamba (state-space) layers and attention layers, with a
sparse mixture of experts (top-2) on every other layer, trained through ``labels`` (``output.loss``).
Its Mamba layers run the reference selective scan on CPU and meta (no CUDA kernels): a Python loop over
every position of the sequence.

Full size: Jamba v0.1 (32 layers, hidden 4096, attention on every 8th layer with 32 heads / 8 KV heads,
16 experts of 14336 top-2 on every other layer, Mamba state 16, vocab 65536, 4096 tokens).
"""

import torch
from transformers import JambaConfig, JambaForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                 expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=2, mamba_d_state=16,
                 mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, vocab_size=256, max_position_embeddings=64),
    "full": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, num_experts=16, num_experts_per_tok=2, expert_layer_period=2,
                 expert_layer_offset=1, attn_layer_period=8, attn_layer_offset=4, mamba_d_state=16,
                 mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=256, vocab_size=65536,
                 max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = JambaConfig(**SIZES[SIZE], use_cache=False)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return JambaForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
