"""Hugging Face Llama4ForCausalLM (the text model) trained through ``labels``: top-1 experts with a shared
expert beside them (experts stacked 3-D, ``gate_up_proj`` fused), chunked attention on three layers of four
(the mask shorter than the sequence in the tiny size), NoPE layers (no rotary) on every fourth, QK norm.

Full size: Llama 4 Scout 17B-16E (48 layers, hidden 5120, 40 heads / 8 KV heads, 16 experts of 8192 top-1
and a shared expert on every layer, vocab 202048, attention chunks of 8192; planned at 4096 tokens).
"""

import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                 num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=16, vocab_size=256,
                 max_position_embeddings=32),
    "full": dict(num_hidden_layers=48, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                 num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16,
                 num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8192,
                 vocab_size=202048, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = Llama4TextConfig(**SIZES[SIZE], use_cache=False, attn_implementation="eager")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Llama4ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
