"""Hugging Face MixtralForCausalLM, as a user writes it: a config from the published values, no
download. Top-2 of 8 experts (SwiGLU) in every block, GQA (8 KV heads), RoPE, untied head, sliding
window off. ``attn_implementation="sdpa"``: a fused attention kernel, as Megatron-Core's flash
attention is. ``use_cache=False``; next-token loss on ``output.logits`` (no auxiliary loss).

Sizes: Mixtral 8x7B (32 layers, hidden 4096, 32 heads / 8 KV heads, experts of 14336, vocab 32000)
and Mixtral 8x22B (56 layers, hidden 6144, 48 heads / 8 KV heads, experts of 16384, vocab 32000):
the published config.json of mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1, and
Megatron-MoE-ModelZoo's model_configs/benchmarking/Mixtral-8x7B.yaml / Mixtral-8x22B.yaml (the same
numbers, seq 4096). Used by autopar.reference_moe (calibration/megatron_moe_h100.yaml).
"""

import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                 max_position_embeddings=32),
    "8x7b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                 max_position_embeddings=4096),
    "8x22b": dict(num_hidden_layers=56, hidden_size=6144, intermediate_size=16384, num_attention_heads=48,
                  num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                  max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = MixtralConfig(**SIZES[SIZE], tie_word_embeddings=False, sliding_window=None, rope_theta=1_000_000.0,
                       use_cache=False, attention_dropout=0.0, attn_implementation="sdpa")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return MixtralForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
