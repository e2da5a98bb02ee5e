"""Context-parallel attention keeps memory linear in the sequence (GPU readiness, B1; issue 35's
acceptance): one cp rank's ring, all-gather and Ulysses attention save for backward bytes that
double when the sequence doubles (benchmarks/cp_memory.py prints the table to 16k tokens) -- where
explicit fp32 score matrices grew four-fold."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "cp_memory", Path(__file__).resolve().parents[2] / "benchmarks" / "cp_memory.py")
cp_memory = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cp_memory)


@pytest.mark.parametrize("kind", ["ring", "allgather", "ulysses"])
def test_saved_bytes_grow_linearly(kind: str) -> None:
    small, big = (cp_memory.saved_bytes(kind, s, heads=4, head_dim=32) for s in (512, 2048))
    assert big / small == pytest.approx(4.0, rel=0.05)  # quadratic would be 16
    scores = 4 * (2048 // 2) * 2048 * 4  # one fp32 score matrix of the local queries
    assert big < scores
