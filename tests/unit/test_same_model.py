"""The structure digest every rank compares (autopar.executor.runtime.same_model): what changes it, what
does not, and the line that names the ranks of each model."""

from __future__ import annotations

from torch import nn

from autopar.executor.runtime.same_model import mismatch_line, structure_digest


def _net(width: int, dtype=None) -> nn.Module:  # noqa: ANN001
    m = nn.Sequential(nn.Linear(8, width), nn.LayerNorm(width), nn.Linear(width, 2))
    return m.to(dtype) if dtype is not None else m


def test_the_digest_sees_shapes_dtypes_and_names_not_values() -> None:
    a, b = _net(16), _net(16)  # other random values, same structure
    assert structure_digest(a) == structure_digest(b)
    assert structure_digest(_net(24))[0] != structure_digest(a)[0]
    import torch

    assert structure_digest(_net(16, torch.bfloat16))[0] != structure_digest(a)[0]
    renamed = nn.Sequential()
    for name, mod in zip(("x", "1", "2"), _net(16)):
        renamed.add_module(name, mod)
    assert structure_digest(renamed)[0] != structure_digest(a)[0]
    assert structure_digest(a)[1] == sum(p.numel() for p in a.parameters())


def test_agreeing_ranks_pass_and_differing_ranks_are_named() -> None:
    same = structure_digest(_net(16))
    other = structure_digest(_net(24))
    assert mismatch_line([same] * 4) is None
    line = mismatch_line([same, other, same, other])
    assert line.startswith("the ranks built different models -- ranks 0, 2 ") and "; ranks 1, 3 " in line
    assert "\n" not in line
    many = mismatch_line([same] * 20 + [other])
    assert "(+12 more)" in many and "rank 20 " in many
