"""Hugging Face XLNetLMHeadModel trained through ``labels``: Transformer-XL relative attention whose
projections are bare ``nn.Parameter`` tensors contracted by ``einsum`` (no Linear to shard), a
sinusoidal relative position encoding built once outside the blocks and handed to every layer, and a
per-head content and position bias; the loss is over every position (no shift).

Full size: XLNet-large (24 layers, d_model 1024, 16 heads of 64, MLP 4096, vocab 32000, 512 tokens).
"""

import torch
from transformers import XLNetConfig, XLNetLMHeadModel

SIZES = {
    "tiny": dict(n_layer=4, d_model=64, n_head=4, d_inner=128, vocab_size=256, seq_len=64),
    "full": dict(n_layer=24, d_model=1024, n_head=16, d_inner=4096, vocab_size=32000, seq_len=512),
}
SIZE = "tiny"
_size = dict(SIZES[SIZE])
SEQ_LEN = _size.pop("seq_len")
CONFIG = XLNetConfig(**_size, dropout=0.0, use_mems_train=False, mem_len=None, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2)


def build_model():
    return XLNetLMHeadModel(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
