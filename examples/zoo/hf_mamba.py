"""Hugging Face MambaForCausalLM (Mamba v1) trained through ``labels``: no attention, a selective scan
whose reference kernel (what runs without the ``mamba-ssm`` CUDA kernels, on CPU and on meta) loops
over every position in Python, a causal depthwise conv, data-dependent ``dt``, ``B``, ``C`` from one
``x_proj``; residuals kept in fp32.

Full size: Mamba-2.8B (64 layers, hidden 2560, state 16, expand 2, vocab 50280; planned at 2048 tokens).
"""

import torch
from transformers import MambaConfig, MambaForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, state_size=16, expand=2, vocab_size=256, seq_len=32),
    "full": dict(num_hidden_layers=64, hidden_size=2560, state_size=16, expand=2, vocab_size=50280,
                 seq_len=2048),
}
SIZE = "tiny"
_size = dict(SIZES[SIZE])
SEQ_LEN = _size.pop("seq_len")
CONFIG = MambaConfig(**_size, use_cache=False)


def build_model():
    return MambaForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
