"""``autopar run --grad-norms``: each parameter's first-step gradient norm in the report, compared
with one rank by name (executor/runtime/grad_digest.py); the zoo's run cells compare them beside
the losses (benchmarks/zoo_lib.py)."""

from __future__ import annotations

import pytest

from autopar.errors import AutoparError
from autopar.executor.runtime.grad_digest import compare_grad_norms
from autopar.executor.runtime.run_options import RunOptions


def test_norms_match_within_the_tolerance_and_name_the_worst_parameter() -> None:
    ref = {"a.weight": 2.0, "b.weight": 0.5, "tiny.bias": 1e-9}
    assert compare_grad_norms(ref, {"a.weight": 2.0 * (1 + 5e-5), "b.weight": 0.5, "tiny.bias": 3e-9}) is None
    # 0.12 % off on one layer (a partial gradient of a replicated layer: MLA at tp 2)
    diff = compare_grad_norms(ref, {"a.weight": 2.0, "b.weight": 0.5 * 1.0012, "tiny.bias": 1e-9})
    assert diff.startswith("step 1 gradient of b.weight") and "rel 1.2e-03" in diff


def test_a_parameter_missing_from_the_run_is_a_mismatch() -> None:
    assert compare_grad_norms({"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 1.0}) == "no gradient norm for b and 1 more"


def test_grad_norms_need_a_report() -> None:
    with pytest.raises(AutoparError, match="--grad-norms writes into the JSON report: add --report PATH"):
        RunOptions(plan_path="p.yaml", grad_norms=True)
    assert RunOptions(plan_path="p.yaml", grad_norms=True, report_path="r.json").grad_norms
