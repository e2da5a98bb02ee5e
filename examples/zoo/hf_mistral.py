"""Hugging Face MistralForCausalLM with a sliding attention window shorter than the sequence, so the
sliding-window mask really cuts. Config defaults otherwise (sdpa attention), ``use_cache=False``.

Full size: Mistral 7B v0.1 (32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336, vocab 32000,
sliding window 4096, 8192 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import MistralConfig, MistralForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, sliding_window=16),
    "full": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192, sliding_window=4096),
}
SIZE = "tiny"
CONFIG = MistralConfig(**SIZES[SIZE], use_cache=False)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return MistralForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), inputs[:, 1:].flatten())
