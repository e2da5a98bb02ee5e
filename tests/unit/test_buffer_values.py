"""A model materialised from its meta build gets the buffer values build_model() computes (an index
table, position ids), not the garbage of fresh storage: the profiler's forward then indexes within
bounds (Swin's relative-position index, CLIP's position ids)."""

from __future__ import annotations

from pathlib import Path

import torch

from autopar.modelfile import load_model_file
from autopar.profiler.layers import materialise

MODEL = '''
import torch
from torch import nn

class Windowed(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(7, 4))
        self.register_buffer("index", torch.arange(9).remainder(7), persistent=False)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x):
        return x * self.table[self.index].sum(0) * self.scale

def build_model():
    return nn.Sequential(Windowed(), Windowed())

def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, 4)
'''


def test_buffers_keep_the_values_build_model_computes(tmp_path: Path) -> None:
    path = tmp_path / "windowed.py"
    path.write_text(MODEL)
    mf = load_model_file(path)
    values = mf.buffer_values()
    assert torch.equal(values["0.index"], torch.arange(9).remainder(7))
    assert torch.equal(values["1.scale"], torch.full((4,), 0.5))
    model = materialise(mf.build("meta"), torch.device("cpu"), values)
    assert torch.equal(model[1].index, torch.arange(9).remainder(7)) and torch.equal(model[0].scale, values["0.scale"])
    assert model[0].table.device.type == "cpu"
    model(torch.randn(2, 4))  # indexes within the table


def test_a_parameter_too_large_for_the_host_leaves_the_fallback(tmp_path: Path) -> None:
    path = tmp_path / "big.py"
    # a parameter of 448 GB: created on the CPU before it is registered, it cannot be
    path.write_text(MODEL.replace("torch.zeros(7, 4)", "torch.empty(7, 4, 2**32)"))
    assert load_model_file(path).buffer_values() == {}
