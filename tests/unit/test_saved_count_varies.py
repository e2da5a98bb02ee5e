"""A region that saves another number of tensors at another shape -- a recurrent scan's reference kernel
saves one state per position -- is fitted by its total saved bytes (graph/scaling._fit_saved); it was a
ValueError that ended `autopar plan` of HF Jamba (Mamba layers) with a traceback."""

from __future__ import annotations

import pytest

from autopar.graph.records import SavedRecord, Trace
from autopar.graph.scaling import _fit_saved


def _trace(per_position: int, seq: int, batch: int = 1) -> Trace:
    states = [SavedRecord(region="block", nbytes=4.0 * batch) for _ in range(per_position * seq)]
    return Trace(saved=[SavedRecord(region="block", nbytes=64.0 * batch * seq, gemm_input=True), *states])


def test_the_total_is_fitted_when_the_tensors_cannot_be_paired() -> None:
    base, half = _trace(1, 16), _trace(1, 8)  # 17 tensors against 9
    fitted = _fit_saved("block", base, _trace(1, 16, batch=2), half, None)
    assert len(fitted) == 17
    assert all(f.exps.s == 1.0 and f.exps.b == 1.0 for f in fitted)  # the total: linear in the sequence
    total_at = sum(f.nbytes for f in fitted)
    assert total_at == pytest.approx(64.0 * 16 + 4.0 * 16)


def test_paired_tensors_keep_their_own_exponents() -> None:
    fitted = _fit_saved("block", _trace(1, 16), None, _trace(1, 16), None)
    assert [f.exps.s for f in fitted] == [0.0] * 17


