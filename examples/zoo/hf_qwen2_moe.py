"""Hugging Face Qwen2MoeForCausalLM: routed experts plus a gated shared expert in every block, GQA,
``use_cache=False``, default attention, next-token loss on ``output.logits``.

Full size: Qwen1.5-MoE-A2.7B (24 layers, hidden 2048, 16 heads, 60 experts of 1408, top-4, shared
expert 5632, vocab 151936, 4096 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=32),
    "full": dict(num_hidden_layers=24, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                 shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                 num_attention_heads=16, num_key_value_heads=16, vocab_size=151936, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = Qwen2MoeConfig(**SIZES[SIZE], use_cache=False)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Qwen2MoeForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
