"""Hugging Face GptOssForCausalLM: a top-k router with a bias (``GptOssTopKRouter``, its own
``weight`` and ``bias`` parameters rather than an ``nn.Linear``) choosing among stacked 3-D expert
weights with per-expert biases (``gate_up_proj`` / ``gate_up_proj_bias``, ``down_proj`` /
``down_proj_bias``; gate and up interleaved, a clamped SwiGLU), called as
``experts(hidden_states, router_indices, routing_weights)``; attention sinks, sliding and full
attention alternating by layer. ``use_cache=False``, next-token loss on ``output.logits``.

Full size: gpt-oss-20b (24 layers, hidden 2880, 64 heads of 64 / 8 KV heads, 32 experts of 2880,
top-4, vocab 201088), at 4096 tokens.
"""

import torch
import torch.nn.functional as F
from transformers import GptOssConfig, GptOssForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                 sliding_window=16, max_position_embeddings=32),
    "full": dict(num_hidden_layers=24, hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
                 num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                 sliding_window=128, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = GptOssConfig(**SIZES[SIZE], use_cache=False, attention_dropout=0.0,
                      rope_parameters=dict(rope_type="default", rope_theta=150000.0))
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return GptOssForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
