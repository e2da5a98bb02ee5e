"""Hugging Face GPTNeoXForCausalLM (Pythia): fused ``query_key_value`` with heads interleaved, parallel
attention + MLP residual, partial rotary, untied head. ``use_cache=False``, default attention.

Full size: Pythia-6.9B (32 layers, hidden 4096, 32 heads, MLP 16384, vocab 50432, 2048 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                 vocab_size=256, max_position_embeddings=32),
    "full": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=16384, num_attention_heads=32,
                 vocab_size=50432, max_position_embeddings=2048),
}
SIZE = "tiny"
CONFIG = GPTNeoXConfig(**SIZES[SIZE], use_cache=False, hidden_dropout=0.0, attention_dropout=0.0)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return GPTNeoXForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
