"""The kernel profiler on CUDA times batches of back-to-back launches between CUDA events (GPU
readiness, M6): one launch between two synchronizes reads a ~10 us round trip as a small GEMM's
time or as the launch overhead; and memory bandwidth is fitted on copies past the GPU's L2 (a
16 MiB copy's read and write fit in an H100's 50 MB L2). Guarded with a stand-in CUDA event clock."""

from __future__ import annotations

import pytest
import torch

from autopar.profiler import kernels


class _Clock:
    """The stand-in GPU's clock: it advances only by the work the stand-in kernels do, so the
    batching under test is measured exactly whatever else the machine runs."""

    now = 0.0


class _Event:
    """torch.cuda.Event's timing contract, on the stand-in GPU's clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = _Clock.now

    def elapsed_time(self, other: "_Event") -> float:
        return (other.t - self.t) * 1e3  # milliseconds, as CUDA events report


def test_cuda_samples_are_batches_between_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    calls = []

    def kernel() -> None:  # 50 us of "GPU work" per launch
        calls.append(1)
        _Clock.now += 5e-5

    got = kernels._time(kernel, torch.device("cuda", 0), warmup=2, repeats=3)
    inner = kernels.batch_size(5e-5)
    assert 10 <= inner <= 40  # about CUDA_BATCH_S of launches per sample
    assert len(calls) == 2 + 1 + 3 * inner  # warm-up, the sizing call, three batches
    assert got == pytest.approx(5e-5)  # per launch, not per batch


def test_batch_size_bounds() -> None:
    assert kernels.batch_size(1.0) == 1  # a long kernel: one per sample
    assert kernels.batch_size(1e-7) == 1000  # a tiny one: capped
    assert kernels.batch_size(0.0) == 1000


def test_bandwidth_is_fitted_past_the_cache() -> None:
    rows = [{"bytes": float(2**p), "bytes_per_s": (9e12 if 2**p < 2**26 else 3.2e12)} for p in range(16, 31, 2)]
    # an H100's L2 is 50 MB: copies below 4 x L2 run from the cache at several times HBM's rate
    assert kernels.fit_bandwidth(rows, 4 * 50e6) == pytest.approx(3.2e12)
    assert kernels.fit_bandwidth(rows) > 3.2e12  # the CPU rule (>= 1 MiB) would read the cache
    assert kernels.cache_bytes(torch.device("cpu")) == 2**20


def test_comm_pairs_cross_the_network_across_nodes() -> None:
    """(M7) the two-rank fit of a multi-node world measures a rank with its peer on the next node
    (the link "inter_node" names), not NVLink neighbours; on one node, neighbours."""
    from autopar.profiler.comm import CUDA_SIZES, DEFAULT_SIZES, pair_layout, sizes_for

    assert pair_layout(4, 4) == [(0, 1), (2, 3)]
    assert pair_layout(5, 5) == [(0, 1), (2, 3)]
    assert pair_layout(16, 8) == [(i, 8 + i) for i in range(8)]
    assert pair_layout(24, 8) == [(i, 8 + i) for i in range(8)]  # the third node has no partner
    pairs = pair_layout(32, 8)
    assert len(pairs) == 16 and all(b - a == 8 for a, b in pairs) and len({r for p in pairs for r in p}) == 32
    # (M7) messages up to 1 GiB on a GPU, where NCCL reaches its bus bandwidth
    assert max(sizes_for(torch.device("cuda", 0))) == 2**30 == max(CUDA_SIZES)
    assert sizes_for(torch.device("cpu")) == DEFAULT_SIZES
