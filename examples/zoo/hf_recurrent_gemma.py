"""Hugging Face RecurrentGemmaForCausalLM (Griffin: RG-LRU recurrent blocks and local attention),
trained through labels.

Full size: RecurrentGemma-2B (26 layers, hidden 2560, two recurrent blocks to one local-attention
block, 10 query heads over one key/value head, a 2048-token window, vocab 256000).
"""

import torch
from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=6, hidden_size=64, intermediate_size=192, num_attention_heads=4,
                 num_key_value_heads=1, lru_width=64, attention_window_size=32, vocab_size=256),
    "full": dict(num_hidden_layers=26, hidden_size=2560, intermediate_size=15360, num_attention_heads=10,
                 num_key_value_heads=1, lru_width=2560, attention_window_size=2048, vocab_size=256000),
}
SIZE = "tiny"
CONFIG = RecurrentGemmaConfig(**SIZES[SIZE], use_cache=False)
SEQ_LEN = 4096 if SIZE == "full" else 64


def build_model():
    return RecurrentGemmaForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
