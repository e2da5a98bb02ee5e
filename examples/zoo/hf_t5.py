"""Hugging Face T5ForConditionalGeneration (encoder-decoder, relative position buckets, RMS-style
LayerNorm), called with ``input_ids`` and ``labels`` as seq2seq trainers do; ``loss_fn`` returns
``output.loss``. Dropout off so runs are comparable across layouts.

Full size: T5-large (24 + 24 layers, d_model 1024, 16 heads of 64, d_ff 4096, vocab 32128, 512 tokens).
"""

import torch
from transformers import T5Config, T5ForConditionalGeneration

SIZES = {
    "tiny": dict(num_layers=4, num_decoder_layers=4, d_model=64, d_kv=16, d_ff=128, num_heads=4,
                 vocab_size=256, seq_len=32),
    "full": dict(num_layers=24, num_decoder_layers=24, d_model=1024, d_kv=64, d_ff=4096, num_heads=16,
                 vocab_size=32128, seq_len=512),
}
SIZE = "tiny"
_size = dict(SIZES[SIZE])
SEQ_LEN = _size.pop("seq_len")
CONFIG = T5Config(**_size, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0)


def build_model():
    return T5ForConditionalGeneration(CONFIG)


def example_inputs(micro_batch_size):
    src = torch.randint(1, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    tgt = torch.randint(1, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": src, "labels": tgt}


def loss_fn(output, inputs):
    return output.loss
