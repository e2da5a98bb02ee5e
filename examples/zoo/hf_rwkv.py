"""Hugging Face RwkvForCausalLM trained through ``labels``: RWKV-4, an RNN trained like a transformer --
time mixing (a WKV recurrence; on CPU and meta the reference kernel is a Python loop over every position)
and channel mixing, each fed a token shift (the previous position's hidden state), no attention.

Full size: RWKV-4 Pile 7B (32 layers, hidden 4096, channel mixing 16384, vocab 50277, 1024 tokens).
"""

import torch
from transformers import RwkvConfig, RwkvForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, attention_hidden_size=64, intermediate_size=256,
                 vocab_size=256, context_length=32),
    "full": dict(num_hidden_layers=32, hidden_size=4096, attention_hidden_size=4096, intermediate_size=16384,
                 vocab_size=50277, context_length=1024),
}
SIZE = "tiny"
CONFIG = RwkvConfig(**SIZES[SIZE], use_cache=False, rescale_every=0)
SEQ_LEN = CONFIG.context_length


def build_model():
    return RwkvForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
