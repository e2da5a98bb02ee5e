"""Hugging Face BloomForCausalLM trained through ``labels``: ALiBi position biases built once in the
model's forward and handed to every block, a fused ``query_key_value`` projection laid out per head
(q, k, v interleaved head by head), a LayerNorm right after the word embeddings, tied embeddings.

Full size: BLOOM-7b1 (30 layers, hidden 4096, 32 heads of 128, MLP 16384, vocab 250880, 2048 tokens).
"""

import torch
from transformers import BloomConfig, BloomForCausalLM

SIZES = {
    "tiny": dict(n_layer=4, hidden_size=64, n_head=4, vocab_size=256, seq_len=64),
    "full": dict(n_layer=30, hidden_size=4096, n_head=32, vocab_size=250880, seq_len=2048),
}
SIZE = "tiny"
_size = dict(SIZES[SIZE])
SEQ_LEN = _size.pop("seq_len")
CONFIG = BloomConfig(**_size, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)


def build_model():
    return BloomForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
