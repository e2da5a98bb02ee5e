"""Tiny GPT whose tp_plan is written the way Hugging Face writes one: model-relative patterns with a
wildcard block index (``layers.*.attn.qkv``), and a loss that reshapes with the vocabulary constant."""

import torch.nn.functional as F

from autopar.models.gpt import GPT, GPTConfig, example_tokens

CONFIG = GPTConfig(num_layers=4, hidden_size=64, num_heads=4, seq_len=32, vocab_size=128, dropout=0.0)
SEQ_LEN = CONFIG.seq_len
VOCAB = CONFIG.vocab_size
tp_plan = {"layers.*.attn.qkv": "colwise", "layers.*.attn.proj": "rowwise",
           "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}


class PlainGPT(GPT):
    _tp_plan = None  # only the file's tp_plan speaks


def build_model():
    return PlainGPT(CONFIG)


def example_inputs(micro_batch_size: int):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].reshape(-1, VOCAB).float(), inputs[:, 1:].reshape(-1))
