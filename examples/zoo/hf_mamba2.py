"""Hugging Face Mamba2ForCausalLM (a state-space model: no attention), trained through labels.

Full size: Mamba-2 2.7B (64 layers, hidden 2560, state 128, vocab 50288).
"""

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, state_size=16, num_heads=4, head_dim=32, n_groups=1,
                 expand=2, chunk_size=16, vocab_size=256),
    "full": dict(num_hidden_layers=64, hidden_size=2560, state_size=128, num_heads=80, head_dim=64, n_groups=1,
                 expand=2, chunk_size=256, vocab_size=50288),
}
SIZE = "tiny"
CONFIG = Mamba2Config(**SIZES[SIZE], use_cache=False)
SEQ_LEN = 4096 if SIZE == "full" else 64


def build_model():
    return Mamba2ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
