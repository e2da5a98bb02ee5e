"""Hugging Face OlmoeForCausalLM: 64 experts top-8 in every block, q/k norms over the whole projection.

Full size: OLMoE-1B-7B (16 layers, hidden 2048, 16 heads, 64 experts of 1024, top-8, vocab 50304, 4096 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import OlmoeConfig, OlmoeForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                 num_attention_heads=4, num_key_value_heads=4, vocab_size=256, max_position_embeddings=32),
    "full": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=1024, num_experts=64,
                 num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
                 max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = OlmoeConfig(**SIZES[SIZE], use_cache=False)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return OlmoeForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
