"""Hugging Face LlamaForCausalLM built from a config (no download), trained as most users train it:
``use_cache=False``, the config's default attention ("sdpa"), next-token cross-entropy on ``output.logits``.

Full size: Llama-2 7B (32 layers, hidden 4096, 32 heads, MLP 11008, vocab 32000, 4096 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=32),
    "full": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = LlamaConfig(**SIZES[SIZE], use_cache=False)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return LlamaForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
