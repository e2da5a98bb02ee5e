"""spec/inplace.py: rowwise outputs the block's code writes in place are found (and only those)."""

import torch
from torch import nn

from autopar.spec.inplace import inplace_outputs


class ParallelBlock(nn.Module):
    """Falcon-style parallel attention and MLP: the MLP's rowwise output is added to in place."""

    def __init__(self, h: int = 8, view_first: bool = False) -> None:
        super().__init__()
        self.attn_in, self.attn_out = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.view_first = view_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn_out(self.attn_in(x).relu())
        m = self.down(self.up(x).relu())
        if self.view_first:
            m.view(-1, m.shape[-1]).add_(a.view(-1, a.shape[-1]))  # a write through a view
        else:
            m += a
        return x + m


STYLES = {"attn_in": "colwise", "attn_out": "rowwise", "up": "colwise", "down": "rowwise"}


def _run(block: nn.Module):
    x = torch.randn(2, 4, 8, device="meta")
    return lambda: block(x)


def test_an_in_place_add_to_a_rowwise_output_is_found() -> None:
    with torch.device("meta"):
        block = ParallelBlock()
    assert inplace_outputs(block, STYLES, _run(block)) == ("down",)


def test_a_write_through_a_view_of_the_output_is_found() -> None:
    with torch.device("meta"):
        block = ParallelBlock(view_first=True)
    assert inplace_outputs(block, STYLES, _run(block)) == ("down",)


def test_out_of_place_code_needs_no_copy() -> None:
    class Plain(ParallelBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(self.up(x).relu()) + self.attn_out(self.attn_in(x).relu())

    with torch.device("meta"):
        block = Plain()
    assert inplace_outputs(block, STYLES, _run(block)) == ()


def test_a_failing_forward_answers_nothing() -> None:
    with torch.device("meta"):
        block = ParallelBlock()

    def broken():
        raise RuntimeError("user code")

    assert inplace_outputs(block, STYLES, broken) == ()
