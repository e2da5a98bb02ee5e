"""A model whose output is its last block's output (no module after the blocks): the block's
backward is the block's, not the post region's (graph/build.py). Before, the loss's gradient hook
on the same tensor ran after the block's and reopened the post region, so the planner priced one
block's backward for the whole post region and none per block."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.graph import build_graph

MODEL = '''
import torch, torch.nn as nn
SEQ_LEN = 32
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)])
        {head_init}
    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return {head_call}
def build_model(): return M()
def example_inputs(micro_batch_size): return torch.randn(micro_batch_size, SEQ_LEN, 64)
def loss_fn(out, inputs): return out.float().pow(2).mean()
'''


def _flops(graph, region: str, phase: str) -> float:  # noqa: ANN001
    return sum(op.flops for op in graph.regions[region].ops if op.phase == phase)


@pytest.mark.parametrize("head", [False, True])
def test_block_backward_is_the_blocks(tmp_path: Path, head: bool) -> None:
    src = MODEL.format(head_init="self.head = nn.Linear(64, 64)" if head else "",
                       head_call="self.head(x)" if head else "x")
    path = tmp_path / ("with_head.py" if head else "bare_output.py")
    path.write_text(src)
    g = build_graph(str(path), dtype="fp32")
    block_fwd, block_bwd = _flops(g, "block", "fwd"), _flops(g, "block", "bwd")
    assert block_fwd > 0
    assert block_bwd == pytest.approx(2 * block_fwd, rel=0.05)  # input and weight gradients
    if head:
        assert _flops(g, "post", "bwd") == pytest.approx(2 * _flops(g, "post", "fwd"), rel=0.05)
    else:
        assert _flops(g, "post", "fwd") == 0 and _flops(g, "post", "bwd") == 0
