"""Hugging Face xLSTMForCausalLM (mLSTM blocks: matrix-memory recurrent cells, no attention),
trained through labels.

The training path is the chunkwise-parallel form in plain torch (``chunkwise--native_autograd``):
within a chunk a masked, gated quadratic form, across chunks a recurrence over the matrix memory.

Full size: xLSTM-7B (32 blocks, width 4096, 8 heads, vocab 50304, chunks of 64).
"""

import torch
from transformers import xLSTMConfig, xLSTMForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, num_heads=4, vocab_size=256, chunk_size=16),
    "full": dict(num_hidden_layers=32, hidden_size=4096, num_heads=8, vocab_size=50304, chunk_size=64),
}
SIZE = "tiny"
CONFIG = xLSTMConfig(**SIZES[SIZE], mode="train", chunkwise_kernel="chunkwise--native_autograd",
                     sequence_kernel="native_sequence__native", step_kernel="native", use_cache=False)
SEQ_LEN = 4096 if SIZE == "full" else 64


def build_model():
    return xLSTMForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
