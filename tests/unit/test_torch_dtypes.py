"""One map from a plan's dtype names to torch dtypes, shared by the tracer, executor and profiler."""

from __future__ import annotations

from pathlib import Path

import torch

from autopar.plan import DTYPES
from autopar.torch_dtypes import TORCH_DTYPES

PACKAGE = Path(__file__).resolve().parents[2] / "autopar"


def test_every_plan_dtype_has_its_torch_dtype():
    assert tuple(TORCH_DTYPES) == DTYPES
    assert TORCH_DTYPES["bf16"] is torch.bfloat16 and TORCH_DTYPES["fp32"] is torch.float32


def test_no_module_keeps_a_map_of_its_own():
    owners = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
              if '"bf16": torch.bfloat16' in p.read_text()]
    assert owners == ["torch_dtypes.py"], owners
