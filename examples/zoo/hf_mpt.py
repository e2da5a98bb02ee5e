"""Hugging Face MptForCausalLM trained the way the HF Trainer calls it: a dict of ``input_ids`` and
``labels``, ``loss_fn`` returns ``output.loss`` (the model's own shifted cross-entropy, which views the
logits by ``config.vocab_size``). Fused ``Wqkv`` reshaped by a constant head count, ALiBi position
bias (one row per head, built outside the blocks), LayerNorm without biases, no rotary tables.

Full size: MPT-7B (32 layers, d_model 4096, 32 heads, MLP 4 x 4096, vocab 50432, 2048 tokens).
"""

import torch
from transformers import MptConfig, MptForCausalLM

SIZES = {
    "tiny": dict(n_layers=4, d_model=64, n_heads=4, expansion_ratio=2, vocab_size=256, max_seq_len=32),
    "full": dict(n_layers=32, d_model=4096, n_heads=32, expansion_ratio=4, vocab_size=50432, max_seq_len=2048),
}
SIZE = "tiny"
CONFIG = MptConfig(**SIZES[SIZE], use_cache=False, resid_pdrop=0.0, emb_pdrop=0.0)  # attention dropout is 0 by default
SEQ_LEN = CONFIG.max_seq_len


def build_model():
    return MptForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
