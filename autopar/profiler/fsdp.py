"""FSDP2's and DTensor's time per parameter tensor beyond their collectives, on the launched ranks
(measured profiles' framework time; priced by autopar.cost.framework). Collective calls: every rank must make them.

A reference model of ``UNITS`` units (each ``LAYERS_PER_UNIT`` linear layers with bias: two tensors
a layer) plus a root layer is trained for a few steps twice on the same ranks: plain (no data
parallelism) and as the executor runs ZeRO-1 (``fully_shard`` per unit and on the root, parameters
kept from forward to backward, AdamW as autopar.executor.parallel.data_parallel builds it). Forward,
backward and optimizer step are timed apart (median over steps of the slowest rank). The figures,
per parameter tensor T:

    gather_s_per_tensor     = (forward_fsdp  - forward_plain  - the units' all-gathers) / T
    reduce_s_per_tensor     = (backward_fsdp - backward_plain - the units' reduce-scatters) / T
    optimizer_s_per_tensor  = (step_fsdp     - step_plain) / T

where each unit's collective is priced exactly as autopar.cost.comm prices it from the fits just
measured (per-hop latency + bytes / bandwidth + rendezvous), so the figures hold only what the cost
model does not already charge. Each is clamped at 0 (a GPU's FSDP2 can hide it entirely).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from autopar.profile_tables import CollectiveFit
from autopar.profiler.comm import hops_and_volume

UNITS = 4
LAYERS_PER_UNIT = 4
WIDTH = 256
BATCH = 32


def _reference(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    units = [nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS_PER_UNIT))) for _ in range(UNITS)]
    return nn.Sequential(*units, nn.Linear(WIDTH, WIDTH))


def _priced(fit: CollectiveFit | None, kind: str, n: int, message_bytes: float, rendezvous_s: float) -> float:
    if fit is None:
        return 0.0
    hops, volume = hops_and_volume(kind, n, message_bytes)
    return hops * fit.latency_s + volume / fit.bandwidth_bytes_per_s + rendezvous_s


def _phase_times(model: nn.Module, x: torch.Tensor, device: torch.device, steps: int) -> tuple[float, float, float]:
    """(forward, backward, optimizer) seconds of one step: the median over ``steps`` (after one
    warm-up) of the slowest rank's time."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    samples: list[tuple[float, float, float]] = []
    for i in range(steps + 1):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t3 = time.perf_counter()
        worst = torch.tensor([t1 - t0, t2 - t1, t3 - t2], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if i:
            samples.append(tuple(float(v) for v in worst))
    return tuple(statistics.median(s[k] for s in samples) for k in range(3))  # type: ignore[return-value]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_fsdp(device: torch.device, fits: Mapping[str, CollectiveFit], rendezvous_s: float, *, steps: int = 6,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The ``measured.comm.fsdp`` section (module docstring) on the whole world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    x = torch.randn(BATCH, WIDTH, device=device)
    plain = _phase_times(_reference(0).to(device), x, device, steps)
    model = _reference(0).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for unit in list(model)[:UNITS]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    sharded = _phase_times(model, x, device, steps)
    tensors = sum(1 for _ in model.parameters())
    layer_bytes = (WIDTH * WIDTH + WIDTH) * 4  # fp32
    messages = [LAYERS_PER_UNIT * layer_bytes] * UNITS + [layer_bytes]  # one collective per unit, root last
    gathers = sum(_priced(fits.get("all_gather"), "all_gather", world, m, rendezvous_s) for m in messages)
    reduces = sum(_priced(fits.get("reduce_scatter"), "reduce_scatter", world, m, rendezvous_s) for m in messages)
    out = {
        "gather_s_per_tensor": max(0.0, sharded[0] - plain[0] - gathers) / tensors,
        "reduce_s_per_tensor": max(0.0, sharded[1] - plain[1] - reduces) / tensors,
        "optimizer_s_per_tensor": max(0.0, sharded[2] - plain[2]) / tensors,
        "tensors": tensors,
        "units": len(messages),
    }
    if log:
        log(f"fsdp: {tensors} tensors in {len(messages)} units: per tensor {out['gather_s_per_tensor'] * 1e6:.0f} us "
            f"gather, {out['reduce_s_per_tensor'] * 1e6:.0f} us reduce, {out['optimizer_s_per_tensor'] * 1e6:.0f} us "
            "optimizer beyond the priced collectives")
    return out
