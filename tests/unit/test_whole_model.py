"""The whole model against the layer table (autopar.profiler.whole): one factor per micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.modelfile import load_model_file
from autopar.profile_tables import LayerPoint, LayerTable
from autopar.profiler.layers import LayerProfileConfig, profile_layers
from autopar.profiler.whole import _composed, apply_whole_model, whole_model_rows

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo" / "odd_names_decoder.py"


def _table() -> LayerTable:
    def pts(scale: float, core: bool = False) -> tuple[LayerPoint, ...]:
        return tuple(LayerPoint(b=b, s=8, tp=tp, fwd_s=scale * b / tp, bwd_s=2 * scale * b / tp,
                                core_fwd_s=scale * b / tp / 4 if core else None) for b in (1, 2) for tp in (1, 2))
    return LayerTable(model_name="m", model_sha256="x", dtype="fp32", seq_len=8, edges_replicated=False,
                      regions={"pre": pts(0.1), "block": pts(1.0, core=True), "post": pts(0.2), "loss": pts(0.05)})


def test_composed_is_the_edges_and_n_blocks_at_tp_1() -> None:
    fwd, bwd = _composed(_table(), 2, 8, num_blocks=3)
    assert fwd == pytest.approx(2 * (0.1 + 3 * 1.0 + 0.2 + 0.05)) and bwd == pytest.approx(2 * fwd)
    assert _composed(_table(), 4, 8, num_blocks=3) is None  # no block point at b = 4


def test_every_point_of_a_timed_micro_batch_is_scaled_by_its_phases_factor() -> None:
    table = _table()
    out = apply_whole_model(table, [{"b": 2, "fwd_s": 0, "bwd_s": 0, "fwd_factor": 1.5, "bwd_factor": 0.5}])
    for region, points in table.regions.items():
        for old, new in zip(points, out.regions[region]):
            f, g = (1.5, 0.5) if old.b == 2 else (1.0, 1.0)
            assert new.fwd_s == pytest.approx(old.fwd_s * f) and new.bwd_s == pytest.approx(old.bwd_s * g)
            assert (new.core_fwd_s is None) == (old.core_fwd_s is None)
            if old.core_fwd_s is not None:
                assert new.core_fwd_s == pytest.approx(old.core_fwd_s * f)


def test_the_factors_are_the_whole_models_times_over_the_tables_composition() -> None:
    mf = load_model_file(ZOO)
    torch.set_num_threads(1)
    cfg = LayerProfileConfig(micro_batches=(1, 2), tps=(1,), cps=(1,), dtype="fp32", warmup=1, repeats=3)
    table = profile_layers(mf, torch.device("cpu"), cfg)
    rows = whole_model_rows(mf, torch.device("cpu"), table, (1, 2), "fp32", warmup=1, repeats=3)
    assert rows is not None and [r["b"] for r in rows] == [1, 2]
    n = len(mf.build("meta").get_submodule(mf_blocks(mf)))
    for r in rows:
        cf, cb = _composed(table, r["b"], mf.seq_len, n)
        assert r["fwd_factor"] == pytest.approx(r["fwd_s"] / cf) and r["bwd_factor"] == pytest.approx(r["bwd_s"] / cb)
        assert 0.2 < r["fwd_factor"] < 5 and 0.2 < r["bwd_factor"] < 5  # the same work, within noise
    assert whole_model_rows(mf, torch.device("meta"), table, (1, 2), "fp32", warmup=0, repeats=1) is None


def mf_blocks(mf) -> str:  # noqa: ANN001
    from autopar.spec import model_spec

    return model_spec(mf, mf.build("meta")).blocks_path
