"""Kernel tables (autopar/kernel_tables.py): the shipped GEMM and attention tables load, name their
sources, interpolate monotonically between their points, and the cost model prices with them."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import yaml

from autopar.cluster import SHIPPED_PROFILES, cluster_from_dict, load_cluster
from autopar.errors import ClusterError
from autopar.kernel_tables import attention_table_from_dict, gemm_table_from_dict

KERNELS = SHIPPED_PROFILES / "kernels"


def _yaml(name: str) -> dict:
    return yaml.safe_load((KERNELS / name).read_text())


def _measured(m: int, n: int, k: int, column: int) -> float:
    """The XLA table's rate (FLOP/s) of the (b*m, n, k) point: its rows of that shape, averaged."""
    rows = [r for r in _yaml("h100-sxm-gemm-xla.yaml")["rows"] if (r[0] * r[1], r[2], r[3]) == (m, n, k)]
    return sum(r[column] for r in rows) / len(rows) * 1e12


def test_shipped_tables_load_and_name_their_source() -> None:
    gemm = gemm_table_from_dict(_yaml("h100-sxm-gemm-xla.yaml"), "gemm")
    attn = attention_table_from_dict(_yaml("h100-sxm-attention-fa3-paper.yaml"), "attention")
    assert "matmul_interpolator_data" in gemm.source and "FlashAttention-3" in attn.source
    # the batch folded into m extends the measured m axis to b x m = 16k rows
    assert gemm.m == (256, 512, 1024, 2048, 4096, 8192, 16384) and gemm.k == (256, 512, 1024, 2048, 4096)
    assert gemm.dtypes() == ("bf16", "fp32") and set(attn.kernels()) == {"fa2", "cudnn", "fa3"}
    # a measured point comes back as measured: the mean of its rows (4096 x 4096 x 4096 bf16 at b 1,
    # 2, 4: 780.194, 771.778, 769.776 TFLOP/s)
    assert gemm.rate(4096, 4096, 4096) == pytest.approx(_measured(4096, 4096, 4096, 4), rel=1e-9)
    assert gemm.rate(16384, 4096, 4096) == pytest.approx(_measured(16384, 4096, 4096, 4), rel=1e-9)


def test_gemm_interpolation_stays_between_its_grid_points() -> None:
    """Trilinear in log2: along each axis, every rate between two grid points lies between theirs,
    and moves monotonically from one to the other."""
    gemm = gemm_table_from_dict(_yaml("h100-sxm-gemm-xla.yaml"), "gemm")
    for (m0, m1), n, k in itertools.product(zip(gemm.m, gemm.m[1:]), gemm.n, gemm.k):
        a, b = gemm.rate(m0, n, k), gemm.rate(m1, n, k)
        xs = [gemm.rate(m0 * (m1 / m0) ** (i / 8), n, k) for i in range(9)]
        assert min(a, b) - 1 <= min(xs) and max(xs) <= max(a, b) + 1
        steps = [y - x for x, y in zip(xs, xs[1:])]
        assert all(s >= -1e-3 for s in steps) or all(s <= 1e-3 for s in steps)


def test_gemm_edges_saturate_above_and_keep_the_smallest_time_below() -> None:
    gemm = gemm_table_from_dict(_yaml("h100-sxm-gemm-xla.yaml"), "gemm")
    assert gemm.rate(65536, 8192, 8192) == gemm.rate(16384, 4096, 4096)
    small = gemm.rate(256, 256, 256)
    # half the rows below the grid: the same time as the smallest measured GEMM, half the FLOPs
    assert gemm.rate(128, 256, 256) == pytest.approx(small / 2)
    assert gemm.rate(64, 64, 64) < gemm.rate(256, 256, 256) < gemm.rate(4096, 4096, 4096)


def test_attention_rates_follow_the_published_figures() -> None:
    attn = attention_table_from_dict(_yaml("h100-sxm-attention-fa3-paper.yaml"), "attention")
    # non-causal: as published; causal: the paper counts half the FLOPs, torch's counter all of them
    assert attn.rate("fa2", backward=False, causal=False, kv_tokens=2048, head_dim=128) == pytest.approx(362e12)
    assert attn.rate("cudnn", backward=False, causal=True, kv_tokens=8192, head_dim=128) == pytest.approx(2 * 529e12)
    # between published lengths and head dimensions: monotone between the neighbours
    xs = [attn.rate("fa2", backward=False, causal=True, kv_tokens=1024 * 2 ** (i / 8), head_dim=96) for i in range(9)]
    assert all(b >= a for a, b in zip(xs, xs[1:]))
    lo = attn.rate("fa2", backward=False, causal=True, kv_tokens=1024, head_dim=64)
    hi = attn.rate("fa2", backward=False, causal=True, kv_tokens=1024, head_dim=128)
    assert min(lo, hi) <= xs[0] <= max(lo, hi)
    # below the shortest published length the first segment's power law continues: CLIP's 257 patches
    r512 = attn.rate("fa2", backward=False, causal=False, kv_tokens=512, head_dim=64)
    assert attn.rate("fa2", backward=False, causal=False, kv_tokens=257, head_dim=64) < r512


def test_causal_backward_is_derived_from_the_forward_mask_ratio() -> None:
    attn = attention_table_from_dict(_yaml("h100-sxm-attention-fa3-paper.yaml"), "attention")
    got = attn.rate("cudnn", backward=True, causal=True, kv_tokens=4096, head_dim=128)
    assert got == pytest.approx(499e12 * (2 * 518e12) / 609e12)


@pytest.mark.parametrize("kind, data, needle", [
    ("gemm", {"kind": "gemm", "dtypes": ["bf16"], "rows": [[1, 256, 256, 256, 6.7]]}, "names no source"),
    ("attention", {"kind": "attention", "sequence": [512, 1024], "kernels": {"x": {"forward": {"full": {64: [1, 2]}}}}},
     "names no source"),
    ("gemm", {"kind": "gemm", "source": "s", "dtypes": ["bf16"],
              "rows": [[1, 256, 256, 256, 6.7], [1, 512, 256, 256, 9.0], [1, 256, 512, 256, 9.0]]}, "full"),
    ("gemm", {"kind": "gemm", "source": "s", "dtypes": ["bf16"], "rows": [[1, 256, 256, 256, -1]]}, "> 0"),
    ("attention", {"kind": "attention", "source": "s", "sequence": [512, 1024],
                   "kernels": {"x": {"forward": {"full": {64: [1]}}}}}, "one rate per key length"),
])
def test_malformed_tables_are_refused_in_one_line(kind: str, data: dict, needle: str) -> None:
    parse = gemm_table_from_dict if kind == "gemm" else attention_table_from_dict
    with pytest.raises(ClusterError, match=needle):
        parse(data, "table.yaml")


def test_profile_names_a_kernel_the_table_has(tmp_path: Path) -> None:
    data = yaml.safe_load((SHIPPED_PROFILES / "h100-80g.yaml").read_text())
    data["kernels"]["attention_kernel"] = "fa9"
    with pytest.raises(ClusterError, match="attention_kernel.*fa2"):
        cluster_from_dict(data, "x", SHIPPED_PROFILES / "h100-80g.yaml")
    data["kernels"] = {"gemm": "no-such-table"}
    with pytest.raises(ClusterError, match="unknown kernel table 'no-such-table'"):
        cluster_from_dict(data, "x", SHIPPED_PROFILES / "h100-80g.yaml")


def test_software_variants_price_their_own_attention_kernel() -> None:
    eager, megatron = load_cluster("h100-80g"), load_cluster("h100-80g-megatron")
    assert (eager.attention_kernel, megatron.attention_kernel) == ("fa2", "cudnn")
    args = dict(head_dim=128, causal=True)
    assert megatron.attention_flops_per_s(4096, **args) > eager.attention_flops_per_s(4096, **args)
    # the same GEMM hardware, at the sustained share of the measured rate
    assert eager.gemm_flops_per_s(8192, 8192, 8192) == megatron.gemm_flops_per_s(8192, 8192, 8192)
    assert eager.gemm_flops_per_s(4096, 4096, 4096) == pytest.approx(
        _measured(4096, 4096, 4096, 4) * eager.sustained_fraction, rel=1e-9)
    # a profile without tables keeps its efficiency curve
    a100 = load_cluster("a100-80g")
    assert a100.gemm_table is None and a100.gemm_flops_per_s(8192, 8192, 8192) == pytest.approx(
        a100.peak_flops * a100.gemm(8192, 8192, 8192))


def test_fp32_plans_price_the_tables_fp32_column() -> None:
    from autopar.profile_conditions import RunConditions, price_for_run

    cluster = load_cluster("h100-80g")
    fp32 = price_for_run(cluster, RunConditions(dtype="fp32", ranks_on_host=8), profile_label="h100-80g").cluster
    assert fp32.gemm_dtype == "fp32" and fp32.attention_table is None
    ratio = fp32.gemm_flops_per_s(4096, 4096, 4096) / cluster.gemm_flops_per_s(4096, 4096, 4096)
    assert ratio == pytest.approx(_measured(4096, 4096, 4096, 5) / _measured(4096, 4096, 4096, 4), rel=1e-9)


def test_traced_attention_carries_its_mask_into_the_graph() -> None:
    """A causal decoder's fused attention ops, forward and backward, are recorded causal (the GPT
    model file calls SDPA with is_causal=True)."""
    from autopar.models.gpt import GPTConfig
    from autopar.reference import gpt_graph

    graph = gpt_graph(GPTConfig(num_layers=1, hidden_size=64, num_heads=4, seq_len=32, vocab_size=128,
                                fused_attention=True))
    attn = [op for op in graph.regions["block"].ops if op.kind == "attn"]
    assert {op.phase for op in attn} == {"fwd", "bwd"} and all(op.causal for op in attn)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_attention_op_carries_its_mask(causal: bool) -> None:
    from autopar.graph.trace import _is_causal

    q = torch.zeros(1, 2, 8, 16)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert _is_causal(op, (q, q, q, 0.0, causal), {}) is causal
    assert _is_causal(op, (q, q, q), {"is_causal": causal}) is causal
    eff = torch.ops.aten._scaled_dot_product_efficient_attention.default
    assert _is_causal(eff, (q, q, q, None, True, 0.0, causal), {}) is causal


def test_a_gpu_profile_measures_its_own_gemm_table_which_replaces_the_published_one() -> None:
    """``autopar profile --device cuda`` times a full grid of GEMM shapes (profiler/kernels.py);
    layered over a shipped profile, that grid is the table every GEMM is priced from."""
    from autopar.cluster import with_measured
    from autopar.profile_tables import measured_from_dict
    from autopar.profiler.kernels import gemm_shapes

    shapes = gemm_shapes(torch.device("cuda"))
    rows = [{"m": m, "n": n, "k": k, "flops_per_s": 1e12 * min(m, n, k) / 16} for m, n, k in shapes]
    h100 = load_cluster("h100-80g")
    gpu = with_measured(h100, measured_from_dict(
        {"device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "dtype": "bf16"}, "gemm": rows,
         "fitted": {"peak_flops": 900e12, "gemm_max": 1.0, "gemm_half_dim": 100.0}}, "measured"))
    assert "autopar profile --device cuda (NVIDIA H100 80GB HBM3)" == gpu.gemm_table.source
    assert gpu.gemm_flops_per_s(1024, 2048, 4096) == pytest.approx(64e12 * h100.sustained_fraction)
    # a CPU profile's squares and skinny shapes are no grid: its roofline fit prices the GEMMs
    cpu_rows = [{"m": m, "n": n, "k": k, "flops_per_s": 1e11} for m, n, k in gemm_shapes(torch.device("cpu"))]
    cpu = with_measured(h100, measured_from_dict(
        {"device": {"type": "cpu", "dtype": "fp32"}, "gemm": cpu_rows,
         "fitted": {"peak_flops": 2e11, "gemm_max": 1.0, "gemm_half_dim": 100.0}}, "measured"))
    assert cpu.gemm_table is None and cpu.gemm_flops_per_s(1024, 1024, 1024) == pytest.approx(
        2e11 * cpu.gemm(1024, 1024, 1024))


def test_gpu_acceptance_compares_a_measured_grid_with_the_published_table() -> None:
    """The first GPU run (benchmarks/gpu_acceptance.py, check 6) says how its measured GEMM grid
    compares with the table the H100 profiles price from: a grid equal to the table reads 1.00."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_acceptance.py"
    spec = importlib.util.spec_from_file_location("gpu_acceptance_for_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gemm = gemm_table_from_dict(_yaml("h100-sxm-gemm-xla.yaml"), "gemm")
    from autopar.profiler.kernels import gemm_shapes

    rows = [{"m": m, "n": n, "k": k, "flops_per_s": gemm.rate(m, n, k) * 0.9} for m, n, k in gemm_shapes(torch.device("cuda"))]
    text = module.gemm_table_comparison(rows, "bf16")
    assert "median 0.90 (0.90-0.90) over 150 shapes" in text  # 5 x 5 x 6: 8192 past the grid's n and k


def test_without_a_table_a_causal_kernel_runs_twice_the_full_count_rate() -> None:
    """A causal flash kernel skips the key blocks above the diagonal: on torch's full-square FLOP
    count its rate is twice a full kernel's, as the tables' causal_half rates are doubled."""
    a100 = load_cluster("a100-80g")
    assert a100.attention_table is None
    for backward in (False, True):
        full = a100.attention_flops_per_s(4096, head_dim=128, causal=False, backward=backward)
        assert a100.attention_flops_per_s(4096, head_dim=128, causal=True, backward=backward) == 2 * full
        assert full == a100.peak_flops * a100.attention_efficiency_at(4096)
