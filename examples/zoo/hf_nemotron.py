"""Hugging Face NemotronForCausalLM: squared-ReLU MLP without a gate, LayerNorm1P (weight stored as
weight - 1), partial rotary (half of each head), GQA.

Full size: Minitron-8B (32 layers, hidden 4096, 48 heads / 8 KV heads of 128, MLP 16384, vocab 256000,
4096 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import NemotronConfig, NemotronForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=32),
    "full": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=16384, num_attention_heads=48,
                 num_key_value_heads=8, head_dim=128, vocab_size=256000, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = NemotronConfig(**SIZES[SIZE], use_cache=False, partial_rotary_factor=0.5)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return NemotronForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
