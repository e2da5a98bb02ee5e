"""GEMM throughput and memory-bandwidth curves of the local device, and the roofline fit to them.

* GEMM: FLOP/s = 2 m n k / median seconds of each (m, n, k) shape. On CUDA a full grid of shapes:
  the measured profile's GEMM table, which the cost model prices every GEMM from in place of the
  cluster profile's published one (autopar.cluster.with_measured). On CPU (and as the roofline
  every profile also carries) fitted to the curve ``peak * prod_d d / (d + half_dim)`` (least
  squares on log FLOP/s, peak in closed form, half_dim by a grid search); written as
  ``peak_flops`` with ``gemm_max = 1``.
* Memory bandwidth: ``y.copy_(x)`` over sizes; bytes/s = 2 * size / seconds. The profile's
  bandwidth is the median over sizes past the caches (>= 1 MiB on CPU; on CUDA >= 4 x the L2, with
  sizes up to 1 GiB), efficiency 1.
* Kernel overhead: the median time of an add of two 1-element tensors (launch + dispatch; on CUDA
  the time per launch of a batch of back-to-back ones, not a synchronize round trip).
* Timing on CUDA: batches of back-to-back calls between CUDA events (``_time``), so a small kernel
  is not read as the ~10 us of a synchronize.
* Optimizer: one ``torch.optim.AdamW`` step (what the executor runs) over the model's own
  parameter shapes when the profiler is given them (the one-block model's: its edges and one block,
  up to OPTIMIZER_MAX_PARAMS), else 16 tensors of 256 Ki parameters; written as the
  ``optimizer_bytes_per_param`` that gives that time at the fitted bandwidth (the cost model's
  optimizer term is bytes per parameter / bandwidth). The shapes matter: AdamW's time per
  parameter depends on the tensor sizes (per-tensor dispatch on CPU, where it is not foreach, and
  whether a tensor's states stay in cache): a 2 M-parameter, 35-tensor decoder's step took 1.8-2.8
  ns per parameter where the 16 x 256 Ki tensors gave 1.5.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from autopar.torch_dtypes import TORCH_DTYPES

CUDA_BATCH_S = 1e-3  # a timed batch of back-to-back launches on CUDA lasts at least this long


def _time(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of one ``fn()``. On CPU each call is timed on its own. On CUDA a call is
    asynchronous and a synchronize round trip (~10 us) would swamp small kernels: each sample is a
    batch of back-to-back calls between two CUDA events (at least CUDA_BATCH_S long), divided by
    its size -- the kernels' own time, launch overhead included only where it is not hidden."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    inner = 1
    samples = []
    for i in range(repeats + 1):  # the first batch (one call) sizes the others
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        per_call = start.elapsed_time(end) / 1e3 / inner
        if i == 0:
            inner = batch_size(per_call)
        else:
            samples.append(per_call)
    return statistics.median(samples)


def batch_size(per_call_s: float, limit: int = 1000) -> int:
    """Calls per timed CUDA batch: enough for CUDA_BATCH_S, at most ``limit``."""
    if per_call_s <= 0:
        return limit
    return max(1, min(limit, math.ceil(CUDA_BATCH_S / per_call_s)))


CUDA_GEMM_GRID = (256, 512, 1024, 2048, 4096, 8192)


def gemm_shapes(device: torch.device) -> list[tuple[int, int, int]]:
    """On CUDA the full (m, n, k) grid of CUDA_GEMM_GRID: a GEMM table of this GPU by shape, which
    replaces the profile's published one (autopar.kernel_tables.gemm_table_from_rows; 216 shapes,
    a few seconds). On CPU squares and four skinny shapes, for the roofline fit."""
    if device.type == "cuda":
        return [(m, n, k) for m in CUDA_GEMM_GRID for n in CUDA_GEMM_GRID for k in CUDA_GEMM_GRID]
    sizes = [64, 128, 256, 512, 1024]
    shapes = [(n, n, n) for n in sizes]
    big = sizes[-1]
    shapes += [(big, big, 64), (big, 64, big), (64, big, big), (big, big, 256)]
    return shapes


def gemm_curve(device: torch.device, dtype: str, warmup: int = 2, repeats: int = 5) -> list[dict[str, float]]:
    rows = []
    dt = TORCH_DTYPES[dtype]
    for m, n, k in gemm_shapes(device):
        a = torch.randn(m, k, device=device, dtype=dt)
        b = torch.randn(k, n, device=device, dtype=dt)
        secs = _time(lambda: a @ b, device, warmup, repeats)
        rows.append({"m": m, "n": n, "k": k, "seconds": secs, "flops_per_s": 2.0 * m * n * k / secs})
    return rows


def cache_bytes(device: torch.device) -> float:
    """The last-level cache a copy must outgrow to measure memory (the GPU's L2; 1 MiB on CPU,
    whose copies of that size already stream from DRAM at this fit's precision)."""
    if device.type == "cuda":
        return float(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 2**26)
    return float(2**20)


def bandwidth_curve(device: torch.device, warmup: int = 2, repeats: int = 5) -> list[dict[str, float]]:
    rows = []
    top = 30 if device.type == "cuda" else 26  # on a GPU up to 1 GiB: 4 x an H100's 50 MB L2 and more
    for p in range(16, top + 1, 2):
        n = 2**p // 4
        x = torch.randn(n, device=device)
        y = torch.empty_like(x)
        secs = _time(lambda: y.copy_(x), device, warmup, repeats)
        rows.append({"bytes": 4.0 * n, "seconds": secs, "bytes_per_s": 2 * 4.0 * n / secs})
    return rows


def kernel_overhead_s(device: torch.device, repeats: int = 200) -> float:
    x = torch.ones(1, device=device)
    return _time(lambda: x + x, device, 20, repeats)


OPTIMIZER_MAX_PARAMS = 2**26  # the model's shapes up to this many parameters (1 GiB of fp32 states and more)


def optimizer_s_per_param(device: torch.device, repeats: int = 9,
                          shapes: Sequence[tuple[int, ...]] | None = None) -> float:
    """Seconds per parameter of one AdamW step over tensors of ``shapes`` (module docstring)."""
    sizes = [math.prod(s) for s in shapes or ()]
    if not sizes or sum(sizes) > OPTIMIZER_MAX_PARAMS:
        shapes = [(2**18,)] * 16
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    return _time(opt.step, device, 2, repeats) / sum(p.numel() for p in params)


def fit_gemm(rows: list[dict[str, float]]) -> tuple[float, float]:
    """(peak_flops, half_dim) of ``peak * prod d/(d+h)`` best matching the measured FLOP/s."""
    best: tuple[float, float, float] | None = None
    for h in [0.0] + [2.0**e for e in range(0, 13)]:
        logs = [math.log(r["flops_per_s"]) - sum(math.log(d / (d + h)) for d in (r["m"], r["n"], r["k"]))
                for r in rows]
        log_peak = statistics.fmean(logs)
        err = sum((x - log_peak) ** 2 for x in logs)
        if best is None or err < best[0]:
            best = (err, math.exp(log_peak), h)
    assert best is not None
    return best[1], max(best[2], 1e-3)


def fit_bandwidth(rows: list[dict[str, float]], min_bytes: float = 2**20) -> float:
    """The median bandwidth of the copies of at least ``min_bytes`` (past the caches: 4 x the GPU's
    L2 on CUDA, profile_kernels), else of all."""
    big = [r["bytes_per_s"] for r in rows if r["bytes"] >= min_bytes] or [r["bytes_per_s"] for r in rows]
    return statistics.median(big)


def profile_kernels(device: torch.device, dtype: str,
                    optimizer_shapes: Sequence[tuple[int, ...]] | None = None) -> dict[str, Any]:
    """{gemm, memory_bandwidth, fitted} sections of the measured profile (``optimizer_shapes``: the
    parameter shapes the optimizer figure is timed on, see the module docstring); the attention
    rows are profiler/attention_kernels.py's."""
    gemm = gemm_curve(device, dtype)
    bw = bandwidth_curve(device)
    peak, half = fit_gemm(gemm)
    bandwidth = fit_bandwidth(bw, 4 * cache_bytes(device) if device.type == "cuda" else 2**20)
    return {
        "gemm": gemm,
        "memory_bandwidth": bw,
        "fitted": {"peak_flops": peak, "gemm_max": 1.0, "gemm_half_dim": half,
                   "memory_bandwidth_bytes_per_s": bandwidth, "memory_efficiency": 1.0,
                   "kernel_overhead_s": kernel_overhead_s(device),
                   "optimizer_bytes_per_param": optimizer_s_per_param(device, shapes=optimizer_shapes) * bandwidth},
    }
