"""Hugging Face FunnelForMaskedLM trained through masked-LM ``labels``: the sequence shrinks inside the network
(the encoder mean-pools the hidden states by 2 between its blocks of layers, keeping the CLS position
apart, while the first layer of each block attends from the pooled queries to the unpooled keys), and
a decoder upsamples the last block's output back to the full length and adds the first block's output
before its layers. Relative-shift position attention, blocks as a list of layer lists.

Full size: Funnel-Transformer large (3 blocks of 8 layers + 2 decoder layers, d_model 1024, 16 heads of
64, FFN 4096, vocab 30522, 512 tokens).
"""

import torch
from transformers import FunnelConfig, FunnelForMaskedLM

SIZES = {
    "tiny": dict(block_sizes=[2, 2], num_decoder_layers=1, d_model=64, n_head=4, d_head=16, d_inner=128,
                 vocab_size=256, seq_len=64),
    "full": dict(block_sizes=[8, 8, 8], num_decoder_layers=2, d_model=1024, n_head=16, d_head=64,
                 d_inner=4096, vocab_size=30522, seq_len=512),
}
SIZE = "tiny"
_size = dict(SIZES[SIZE])
SEQ_LEN = _size.pop("seq_len")
CONFIG = FunnelConfig(**_size, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def build_model():
    return FunnelForMaskedLM(CONFIG)


def example_inputs(micro_batch_size):
    # masked-LM batches: every 4th token replaced by the mask id (4), only those positions scored; the
    # same count in every sample, so the loss of 2 ranks' halves averages to the loss of the whole batch
    labels = torch.randint(5, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    ids = labels.clone()
    ids[:, 1::4] = 4
    labels[ids != 4] = -100
    return {"input_ids": ids, "labels": labels}


def loss_fn(output, inputs):
    return output.loss
