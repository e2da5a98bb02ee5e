"""``autopar profile`` times the block at SEQ_LEN / cp tokens by cutting the inputs' sequence; a
channel count equal to SEQ_LEN (HF Whisper's 16 mel bins at SEQ_LEN 16) is kept whole, found by how
the model takes the inputs cut, as the planner finds it (graph.build.sequence_keep) -- where the
profile crashed with the conv stem's channel error."""

from __future__ import annotations

from pathlib import Path

import torch

from autopar.modelfile import load_model_file
from autopar.profiler.layers import LayerProfileConfig, profile_layers

MODEL = '''
"""A conv stem over channels whose count equals SEQ_LEN, then a block list over the sequence."""
import torch
from torch import nn

SEQ_LEN = 8
CHANNELS = 8  # the same size as the sequence: only the model's flow tells the two apart


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(CHANNELS, 16, 1)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):  # x: (batch, channels, sequence)
        h = self.stem(x).transpose(1, 2)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, CHANNELS, SEQ_LEN)
'''


def test_profile_cuts_the_sequence_not_a_channel_count_of_its_size(tmp_path: Path) -> None:
    path = tmp_path / "conv_stem.py"
    path.write_text(MODEL)
    torch.set_num_threads(1)
    cfg = LayerProfileConfig(micro_batches=(1, 2), tps=(1,), cps=(1, 2), dtype="fp32", warmup=0, repeats=1)
    table = profile_layers(load_model_file(path), torch.device("cpu"), cfg)
    assert {(p.b, p.s) for p in table.regions["block"]} == {(1, 8), (2, 8), (1, 4), (2, 4)}
