"""Grouped GEMMs under autocast (executor/runtime/grouped_autocast.py): torch's grouped_mm is not on
autocast's lists and its GPU kernels (and meta kernel) take bf16 only, so a part that trains fp32
parameters under autocast -- Hugging Face 5's stacked experts cast the rows to the weight's dtype --
would fail on a GPU. The mode casts the operands to the autocast dtype; outside autocast it does nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.executor.runtime.grouped_autocast import GroupedMMAutocast, holds_stacked_weights

pytestmark = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")


def _operands():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    a = mode.from_tensor(torch.randn(64, 32))
    w = mode.from_tensor(torch.randn(4, 32, 16, requires_grad=True))
    offs = mode.from_tensor(torch.tensor([16, 32, 48, 64], dtype=torch.int32))
    return mode, a, w, offs


def test_fp32_operands_fail_the_kernel_check_without_the_mode() -> None:
    mode, a, w, offs = _operands()
    with mode, torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="BF16"):
        F.grouped_mm(a, w, offs=offs)


def test_under_autocast_the_operands_are_cast_and_gradients_come_back_fp32() -> None:
    mode, a, w, offs = _operands()
    with mode, torch.autocast("cpu", dtype=torch.bfloat16), GroupedMMAutocast("cpu", torch.bfloat16):
        y = F.grouped_mm(a, w, offs=offs)
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def test_outside_autocast_nothing_is_cast() -> None:
    mode, a, w, offs = _operands()
    with mode, GroupedMMAutocast("cpu", torch.bfloat16), pytest.raises(RuntimeError, match="BF16"):
        F.grouped_mm(a, w, offs=offs)


def test_only_models_with_stacked_weights_get_the_mode() -> None:
    assert not holds_stacked_weights([nn.Linear(4, 4)])
    stacked = nn.Module()
    stacked.w = nn.Parameter(torch.zeros(4, 8, 8))
    assert holds_stacked_weights([nn.Linear(4, 4), stacked])
