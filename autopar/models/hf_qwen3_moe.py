"""Hugging Face Qwen3MoeForCausalLM, as a user writes it: a config from the published values, no
download. Every block a mixture of experts (``decoder_sparse_step`` 1, no dense layers), top-8 of
128 routed experts (no shared expert), GQA with per-head q/k RMSNorm, head dim 128 (64 heads: the
query projection is 8192 wide on a 4096 model), untied head. ``attn_implementation="sdpa"``: a
fused attention kernel, as Megatron-Core's flash attention is. ``use_cache=False``; next-token loss
on ``output.logits`` (the router's auxiliary loss is not added).

Full size (``SIZE = "235b-a22b"``): Qwen3-235B-A22B -- the published config.json of
Qwen/Qwen3-235B-A22B (94 layers, hidden 4096, 64 heads / 4 KV heads of 128, 128 experts of 1536,
top-8, vocab 151936, rope theta 1e6), and Megatron-MoE-ModelZoo's
model_configs/benchmarking/Qwen3-235B-A22B.yaml (the same numbers, seq 4096). Used by
autopar.reference_moe (calibration/megatron_moe_h100.yaml).
"""

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                 vocab_size=256, max_position_embeddings=32),
    "235b-a22b": dict(num_hidden_layers=94, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                      num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                      num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = Qwen3MoeConfig(**SIZES[SIZE], decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                        tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6, use_cache=False,
                        attention_dropout=0.0, attn_implementation="sdpa")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Qwen3MoeForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
