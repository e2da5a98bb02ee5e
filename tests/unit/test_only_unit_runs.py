"""A probe of one unit of a list of differing blocks runs block 0 and that unit only
(spec/short_run.only_unit_runs): the others answer with block 0's output, so a list of blocks
that loop over the sequence in Python is not run whole for every unit kind's probe."""

from __future__ import annotations

import torch
from torch import nn

from autopar.spec.short_run import only_unit_runs


class Counted(nn.Module):
    def __init__(self, width: int, calls: list[int], index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.calls, self.index = calls, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(self.index)
        return self.lin(x) + x


def test_only_block_zero_and_the_probed_unit_run_and_forwards_come_back() -> None:
    calls: list[int] = []
    blocks = nn.ModuleList([Counted(8, calls, i) for i in range(5)])

    def run() -> torch.Tensor:
        x = torch.zeros(2, 8)
        for b in blocks:
            x = b(x)
        return x

    with only_unit_runs(blocks, blocks[3]):
        out = run()
    assert calls == [0, 3] and out.shape == (2, 8)
    calls.clear()
    run()
    assert calls == [0, 1, 2, 3, 4]  # the real forwards restored
