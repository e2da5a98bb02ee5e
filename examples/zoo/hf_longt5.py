"""Hugging Face LongT5ForConditionalGeneration trained through ``labels``: an encoder whose attention is
transient-global (each token attends to a local window of ``local_radius`` either side, in blocks, plus
one summary token per ``global_block_size`` tokens computed inside the layer), a full-attention T5
decoder with cross-attention, relative position buckets in the first block of each stack, gated GELU.

Full size: LongT5-TGlobal-large (24 + 24 layers, d_model 1024, 16 heads of 64, d_ff 2816, vocab 32128,
4096 input tokens and 512 target tokens, local radius 127, global blocks of 16).
"""

import torch
from transformers import LongT5Config, LongT5ForConditionalGeneration

SIZES = {
    "tiny": dict(num_layers=4, num_decoder_layers=4, d_model=64, d_kv=16, d_ff=128, num_heads=4,
                 vocab_size=256, local_radius=8, global_block_size=4, seq_len=64),
    "full": dict(num_layers=24, num_decoder_layers=24, d_model=1024, d_kv=64, d_ff=2816, num_heads=16,
                 vocab_size=32128, local_radius=127, global_block_size=16, seq_len=4096),
}
SIZE = "tiny"
_size = dict(SIZES[SIZE])
SEQ_LEN = _size.pop("seq_len")
CONFIG = LongT5Config(**_size, encoder_attention_type="transient-global", feed_forward_proj="gated-gelu",
                      dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0)


def build_model():
    return LongT5ForConditionalGeneration(CONFIG)


def example_inputs(micro_batch_size):
    src = torch.randint(1, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    tgt = torch.randint(1, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN // 8))  # a summary of the document
    return {"input_ids": src, "labels": tgt}


def loss_fn(output, inputs):
    return output.loss
