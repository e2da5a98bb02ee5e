"""Collective bandwidth profile on the launched ranks (run under torchrun; collective calls).

For each of all-reduce, all-gather, reduce-scatter, all-to-all and P2P, and each message size M
(the full tensor, as autopar.cost.comm counts it), the time of one call is the median over
``repeats`` calls of the slowest rank's time. Groups: the whole world and, when it has more than two
ranks, pairs too, so that latency (per hop) and bandwidth separate. The pairs (0, 1), (2, 3), ...
all run at once, as the parallel groups of a run do (the cp rings and dp groups of a dp2 x cp2
plan communicate at the same time): measured with ranks {0, 1} alone, the others idle, a pair had
the whole machine to itself and a dp2 x cp2 Ulysses plan ran 27 % slower than predicted. Each collective is
fitted to the cost model's own formula, with the least total relative error (robust to one slow
point: ``fit_collective``)

    t = hops(n) * latency_s + volume(n, M) / bandwidth_bytes_per_s

(all-reduce: hops 2(n-1), volume 2(n-1)/n M; all-gather / reduce-scatter / all-to-all: n-1 and
(n-1)/n M; P2P: 1 and M), so the fitted figures plug straight into ``Link.fits``. A time above that
of a larger message in the same group is lowered to it first (``monotone_times``: a stall, not the
link). P2P is the executor's neighbour exchange between the two ranks of each pair
(``ring_attention.send_recv``: each sends M and receives M at once, back to back, as a
ring-attention shift or a pipeline's steady state does).

Rendezvous: a blocking collective between bursts of compute also waits for members the OS has
descheduled when ranks share cores (``_rendezvous_time``); measured once and stored as
``rendezvous_s``, the cost model adds it to every collective call on that link.

All ranks of one torchrun are taken as one link: ``intra_node`` on one node (``--standalone``),
``inter_node`` when LOCAL_WORLD_SIZE < WORLD_SIZE (the measured groups then span nodes).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from autopar.profile_tables import COLLECTIVES, CollectiveFit

DEFAULT_SIZES = tuple(2**p for p in range(10, 25, 2))  # 1 KiB .. 16 MiB (CPU ranks)
# NCCL reaches its bus bandwidth only at hundreds of MiB (nccl-tests sweep to GBs): a fit to small
# messages under-reads it and over-prices FSDP's block gathers and DDP's 25 MiB buckets.
CUDA_SIZES = tuple(2**p for p in range(10, 31, 2))  # 1 KiB .. 1 GiB


def sizes_for(device: torch.device) -> tuple[int, ...]:
    return CUDA_SIZES if device.type == "cuda" else DEFAULT_SIZES


def hops_and_volume(kind: str, n: int, message_bytes: float) -> tuple[float, float]:
    """The cost model's (hops, bytes on the wire per rank) of one collective (autopar.cost.comm)."""
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n * message_bytes
    if kind == "p2p":
        return 1.0, message_bytes
    return float(n - 1), (n - 1) / n * message_bytes


def monotone_times(points: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """``points`` (ranks, bytes, seconds) with each time lowered to the fastest time of a message at
    least as large in the same group size: a larger message cannot take less time, so a small
    message slower than a larger one was a stall (a descheduled rank on a shared machine), not the
    link. The fit uses these; the profile keeps the measured points."""
    out = []
    for n, m, t in points:
        floor = min(t2 for n2, m2, t2 in points if n2 == n and m2 >= m)
        out.append((n, m, floor))
    return out


def fit_collective(kind: str, points: list[tuple[int, float, float]]) -> CollectiveFit:
    """The non-negative ``(a, b)`` of ``t = hops * a + volume * b`` (``b`` = 1 / bandwidth) with the
    least total *relative* error over (ranks, bytes, seconds), after ``monotone_times``:

        minimise  sum_i |hops_i a + volume_i b - t_i| / t_i   subject to  a >= 0, b > 0

    Relative, so that a 1 KiB point (~1 ms) weighs as much as a 16 MiB one (~40 ms): squared
    absolute residuals let the largest messages' noise set the latency. Absolute values, not
    squares, so that one slow point does not move the fit: on 2 gloo ranks a 16 MiB reduce-scatter
    took 80 ms where 4 MiB took 6 ms, and least squares answered latency 0 and 0.11 GB/s (a 25 MiB
    bucket priced ~3x its time). The problem is a linear programme in two variables, so an optimum
    lies on a vertex: two residuals zero, or one residual zero and the other variable zero.
    ``_vertices`` enumerates them (n^2 for n points, ~16 here; b > 0) and takes the best exactly. The
    returned fit carries the measured ``points``."""
    rows = [(*hops_and_volume(kind, n, m), t) for n, m, t in monotone_times(points) if t > 0]

    def cost(a: float, b: float) -> float:
        return sum(abs(h * a + v * b - t) / t for h, v, t in rows)

    a, b = min(_vertices(rows), key=lambda ab: cost(*ab), default=(0.0, 0.0))
    return CollectiveFit(kind=kind, latency_s=a, bandwidth_bytes_per_s=1.0 / max(b, 1e-30), points=tuple(points))


def _vertices(rows: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """The feasible vertices of ``fit_collective``'s programme over rows (hops, volume, seconds),
    less those without a bandwidth term (b = 0): a link's bandwidth is finite, and where the points
    cannot tell it (times flat over sizes, as after a stall ``monotone_times`` lowered), latency
    alone would price a 25 MiB bucket like 4 KiB; the bandwidth-only vertex through a point is
    always there instead."""
    out: list[tuple[float, float]] = []
    for i, (h1, v1, t1) in enumerate(rows):
        if v1 > 0:
            out.append((0.0, t1 / v1))  # bandwidth alone
        for h2, v2, t2 in rows[i + 1:]:
            det = h1 * v2 - h2 * v1
            if abs(det) <= 1e-12 * (abs(h1 * v2) + abs(h2 * v1)):
                continue  # the same point twice (or proportional): no vertex
            a = (t1 * v2 - t2 * v1) / det
            b = (h1 * t2 - h2 * t1) / det
            if a >= 0 and b > 0:
                out.append((a, b))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], repeats: int, group: Any, device: torch.device, inner: int) -> float:
    """Median over ``repeats`` of the slowest member's time of ``inner`` back-to-back calls of
    ``fn``, divided by ``inner`` (amortises the skew the barrier leaves between ranks)."""
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        elapsed = torch.tensor([(time.perf_counter() - t0) / inner], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        samples.append(float(elapsed))
    return statistics.median(samples)


def _collective(kind: str, n: int, message_bytes: int, group: Any, device: torch.device) -> Callable[[], Any]:
    numel = max(n, (message_bytes // 4) // n * n)
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // n, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, shard, group=group)
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, full, group=group)
    if kind == "all_to_all":
        # As the executor's Ulysses attention calls it: the autograd functional collective, waited
        # on. On gloo/CPU it takes ~2 ms for 1 MiB between two ranks where dist.all_to_all_single
        # takes ~1 ms; the fit must price what runs (only Ulysses uses all-to-all).
        import torch.distributed._functional_collectives as fc

        return lambda: fc.wait_tensor(fc.all_to_all_single_autograd(full, None, None, group))
    raise ValueError(kind)


def _p2p_time(message_bytes: int, repeats: int, device: torch.device, pair: Any) -> float:
    """One neighbour exchange as the executor runs it (``ring_attention.send_recv``: a batched
    isend + irecv, both directions at once, as in a ring shift or a 1F1B steady state) between the
    two ranks of ``pair`` (this rank's pair group, None: this rank has no partner), back to back,
    every pair at once as a run's cp rings and pipeline neighbours exchange at once. Collective
    over the world; returns the slowest pair's time.

    A one-way ping-pong measured ~0.35 ms for 1 MiB on gloo/CPU where the executor's exchange
    takes ~1.5-4 ms: the fit must price what runs."""
    from autopar.executor.parallel.ring_attention import send_recv

    buf = torch.ones(max(1, message_bytes // 4), device=device)
    samples = []
    inner = max(4, min(20, 2**23 // message_bytes))
    partner = None if pair is None else 1 - dist.get_rank(group=pair)
    for i in range(repeats + 1):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        if pair is not None:
            for _ in range(inner):
                send_recv(buf, partner, partner, pair)
        _sync(device)
        elapsed = time.perf_counter() - t0
        if i:
            samples.append(elapsed / inner)
    value = torch.tensor([statistics.median(samples) if pair is not None else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _rendezvous_time(device: torch.device, pair: Any, repeats: int) -> float:
    """What a blocking collective costs between bursts of compute beyond its own time: every rank
    alternates ~``BURST`` of GEMMs with a small all-to-all in its pair (as a cp rank alternates
    attention steps with exchanges), and the loop's time per call is compared with the bursts alone
    plus the collectives alone. Where ranks share cores, a rank reaching the collective waits for a
    partner the OS has descheduled (at 4 single-threaded ranks on 2 cores ~1.7 ms per call; noise
    on GPU). Collective over the world; the median over ``repeats`` of the slowest rank, >= 0."""
    import torch.distributed._functional_collectives as fc

    a = torch.randn(192, 192, device=device)
    x = torch.ones(2**16, device=device)
    calls = 32

    def burst() -> None:
        for _ in range(20):
            a @ a

    def exchange() -> None:
        if pair is not None:
            fc.wait_tensor(fc.all_to_all_single_autograd(x, None, None, pair))

    def per_call(work: Callable[[], None]) -> float:  # over the world: every pair at once
        return _timed(work, 1, None, device, calls)

    samples = []
    for _ in range(repeats):
        both = per_call(lambda: (burst(), exchange()))
        samples.append(both - per_call(burst) - per_call(exchange))
    return max(0.0, statistics.median(samples))


def pair_layout(world: int, local_world: int) -> list[tuple[int, int]]:
    """Disjoint rank pairs that all exchange at once to measure the two-rank link: on one node
    (0, 1), (2, 3), ...; across nodes each rank with its peer on the next node, (r, r + local_world)
    for the nodes taken two by two, so the "inter_node" fit crosses the network, not NVLink."""
    if local_world >= world or local_world <= 0:
        return [(first, first + 1) for first in range(0, world - 1, 2)]
    nodes = world // local_world
    return [(k * local_world + i, (k + 1) * local_world + i)
            for k in range(0, nodes - 1, 2) for i in range(local_world)]


def _pair_groups() -> Any:
    """This rank's group of ``pair_layout`` (collective: every rank creates every group), or None
    for a rank left out (an odd rank, or a node without a partner)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for pair in pair_layout(world, int(os.environ.get("LOCAL_WORLD_SIZE", world))):
        group = dist.new_group(list(pair))
        if rank in pair:
            mine = group
    return mine


def profile_comm(device: torch.device, sizes: tuple[int, ...] | None = None, repeats: int = 5,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure and fit every collective (collective call: every rank must make it) over ``sizes``
    (default ``sizes_for(device)``). Returns the ``comm`` section and ``memory_baseline_bytes`` (max
    over ranks of the RSS before the sweep)."""
    sizes = sizes or sizes_for(device)
    world = dist.get_world_size()
    # What a rank holds before its model: python, torch, the process group after a first
    # collective -- measured before the sweep's large messages inflate the peak.
    dist.all_reduce(torch.zeros(1, device=device))
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64, device=device)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    pair = _pair_groups() if world > 2 else dist.group.WORLD
    groups = [(world, dist.group.WORLD)] + ([(2, pair)] if world > 2 else [])
    fits: dict[str, CollectiveFit] = {}
    for kind in COLLECTIVES:
        points: list[tuple[int, float, float]] = []
        for m in sizes:
            if kind == "p2p":
                points.append((2, float(m), _p2p_time(m, repeats, device, pair)))
                continue
            for n, group in groups:
                inner = max(1, min(20, 2**21 // m))
                t = _timed(_collective(kind, n, m, group, device), repeats, group, device, inner) if group is not None else 0.0
                if n < world:  # every pair ran at once: the slowest pair's time
                    slowest = torch.tensor([t], dtype=torch.float64, device=device)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    t = float(slowest)
                points.append((n, float(m), t))
        fits[kind] = fit_collective(kind, points)
        dist.barrier()
        if log:
            f = fits[kind]
            log(f"{kind}: latency {f.latency_s * 1e6:.1f} us, bandwidth {f.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    rendezvous = _rendezvous_time(device, pair, repeats)
    if log:
        log(f"rendezvous: {rendezvous * 1e6:.1f} us per blocking collective between compute")
    link = "inter_node" if int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world else "intra_node"
    return {"fits": fits, "ranks": world, "link": link, "memory_baseline_bytes": float(rss), "rendezvous_s": rendezvous}
