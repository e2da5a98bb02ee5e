"""A GPU profile's own fused-attention rates replace the published attention table
(autopar/profiler/attention_kernels.py, kernel_tables.attention_table_from_rows,
cluster.with_measured), as its own GEMM grid replaces the published GEMM table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from autopar.cluster import ClusterError, load_cluster, with_measured
from autopar.kernel_tables import MEASURED_ATTENTION_KERNEL, attention_table_from_rows
from autopar.profile_tables import measured_from_dict
from autopar.profiler.attention_kernels import attention_curve

SEQS = (512, 1024, 2048)


def _rows(rate_tflops: float = 400.0) -> list[dict]:
    """A full synthetic grid: the rate grows with the key length, backward at 0.8 of forward."""
    return [{"direction": d, "mask": m, "head_dim": hd, "kv_tokens": s,
             "flops_per_s": rate_tflops * 1e12 * (s / 2048) ** 0.2 * (0.8 if d == "backward" else 1.0)}
            for d in ("forward", "backward") for m in ("full", "causal") for hd in (64, 128) for s in SEQS]


def test_the_curve_times_every_point_in_torchs_flop_count() -> None:
    rows = attention_curve(torch.device("cpu"), "fp32", seqs=(32, 64), head_dims=(16,), tokens=128, width=32,
                           warmup=1, repeats=1)
    assert len(rows) == 2 * 2 * 2  # key lengths x masks x directions
    assert all(r["flops_per_s"] > 0 and r["seconds"] > 0 for r in rows)
    fwd = next(r for r in rows if r["direction"] == "forward" and r["kv_tokens"] == 64 and r["mask"] == "full")
    bwd = next(r for r in rows if r["direction"] == "backward" and r["kv_tokens"] == 64 and r["mask"] == "full")
    # torch's counter: the forward's two matmuls over the whole scores, the backward's five
    flops_fwd = 4 * (128 // 64) * (32 // 16) * 64 * 64 * 16
    assert fwd["flops_per_s"] * fwd["seconds"] == pytest.approx(flops_fwd)
    assert bwd["flops_per_s"] * bwd["seconds"] == pytest.approx(2.5 * flops_fwd)


def test_rows_make_a_table_exact_at_the_measured_points() -> None:
    rows = _rows()
    table = attention_table_from_rows(rows, MEASURED_ATTENTION_KERNEL, "test")
    assert table is not None and table.sequence == tuple(float(s) for s in SEQS)
    for r in rows:
        got = table.rate(MEASURED_ATTENTION_KERNEL, backward=r["direction"] == "backward", causal=r["mask"] == "causal",
                         kv_tokens=r["kv_tokens"], head_dim=r["head_dim"])
        assert got == pytest.approx(r["flops_per_s"])
    # a point missing from the grid: no table (the published one stays)
    assert attention_table_from_rows(rows[1:], MEASURED_ATTENTION_KERNEL, "test") is None


def test_a_measured_profile_prices_attention_from_its_own_rates() -> None:
    base = load_cluster("h100-80g")
    measured = measured_from_dict({"device": {"type": "cuda", "name": "H100", "dtype": "bf16"},
                                   "attention": _rows(300.0)}, "test")
    c = with_measured(base, measured)
    assert c.attention_kernel == MEASURED_ATTENTION_KERNEL and c.attention_table is not base.attention_table
    rate = c.attention_flops_per_s(1024, head_dim=128, causal=True, backward=False)
    assert rate == pytest.approx(c.sustained_fraction * 300e12 * 0.5 ** 0.2)
    # without rows the published table stays
    plain = with_measured(base, dataclasses.replace(measured, attention=()))
    assert plain.attention_table is base.attention_table and plain.attention_kernel == base.attention_kernel


def test_profile_files_carry_the_rows_and_refuse_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"name": "mine", "base": "h100-80g",
                                    "measured": {"device": {"type": "cuda", "name": "H100", "dtype": "bf16"},
                                                 "attention": _rows()}}))
    assert load_cluster(str(path)).attention_kernel == MEASURED_ATTENTION_KERNEL
    bad = _rows()
    bad[0] = {**bad[0], "mask": "sliding"}
    path.write_text(yaml.safe_dump({"name": "mine", "base": "h100-80g", "measured": {"attention": bad}}))
    with pytest.raises(ClusterError, match=r"attention\[0\]: direction must be forward or backward, mask full or causal"):
        load_cluster(str(path))
