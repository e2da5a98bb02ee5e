"""Leave-one-source-out validation (autopar.reference_fit): the fit really re-derives the constants.

The oracle is synthetic: the published step times of the Megatron rows are replaced by the cost
model's own predictions under known constants, and the fit, started from the shipped ones, must
find those constants again -- then a held-out figure measures a real refit, not the shipped values.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from autopar.reference_fit import FITTED, errors, fit, holdout, shipped_values, source_rows
from autopar.reference_h100 import public_runs


@functools.lru_cache(maxsize=None)
def _megatron_rows() -> tuple:
    return tuple(source_rows("dgxc") + source_rows("megatron_core_r08"))


def test_the_fit_finds_the_constants_that_made_the_times() -> None:
    truth = {**shipped_values(), "sustained fraction": 0.78, "H100 memory": 0.45, "overlap cost (Megatron)": 0.25}
    rows = _megatron_rows()
    made = [dataclasses.replace(r, published=r.published * (1 + e)) for r, e in zip(rows, errors(rows, truth))]
    got, kept = fit(made, shipped_values(), iterations=10)
    # no Megatron row runs on h100-80g (nor on an A100): those constants cannot be re-derived
    assert {"overlap cost (FSDP2)", "A100 gemm_max"} <= set(kept)
    fitted = ("sustained fraction", "H100 memory", "overlap cost (Megatron)")
    assert not set(fitted) & set(kept)
    for name in fitted:
        assert got[name] == pytest.approx(truth[name], abs=0.005), name
    assert max(abs(e) for e in errors(made, got)) < 0.001
    assert got["sustained fraction"] != shipped_values()["sustained fraction"]


def test_every_constant_sits_in_its_bounds_and_the_shipped_profiles() -> None:
    shipped = shipped_values()
    for k in FITTED:
        assert k.low < shipped[k.name] < k.high, k.name


def test_leaving_a_source_out_changes_what_is_fitted() -> None:
    folds = {f.source: f for f in holdout(("dgxc", "megatron_core_r08", "sc21", "korthikanti_t4"))}
    assert folds["dgxc"].values["sustained fraction"] != folds["megatron_core_r08"].values["sustained fraction"]
    assert folds["sc21"].values["A100 gemm_half_dim"] != folds["korthikanti_t4"].values["A100 gemm_half_dim"]
    # a fold fits its own GPU's constants only: the A100 ones stay as shipped in an H100 fold
    assert folds["dgxc"].values["A100 gemm_max"] == shipped_values()["A100 gemm_max"]
    assert len(folds["dgxc"].held_out) == len(public_runs("dgxc")) and len(folds["korthikanti_t4"].held_out) == 10
    assert folds["torchtitan"].names == tuple(r.name for r in public_runs("torchtitan"))
