"""How fast this machine runs now against when its profile was measured (``validate`` on CPU).

A shared machine's speed moves by tens of percent over minutes: on the 2-core project machine six
profiles of one model taken within half an hour priced its best 2-rank plan from 0.095 s to
0.150 s a step, while validate measured 0.10-0.13 s throughout. A step-time error read alone mixes
the cost model's error with that drift. So ``validate`` times the profile's own contention
reference (autopar.profiler.contention: the model file's one-block model, forward and backward at
the largest profiled micro-batch, one thread, CPU time times the core share) on every rank at once
just after training -- the run's own concurrency, the level R of the curve -- and compares the
median over ranks with the profile's curve at R (autopar.profile_conditions.slowdown):

    drift factor = reference now / reference in the profile at R

The report prints it and the step-time error against the prediction times that factor, beside the
plain error: what the model would have said of the machine as it is now.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.modelfile import ModelFile

REPEATS = 9


@dataclass(frozen=True, kw_only=True)
class MachineDrift:
    """The contention reference at ``ranks`` ranks: in the profile and now (module docstring)."""

    ranks: int
    profiled_s: float
    now_s: float

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.profiled_s <= 0 or self.now_s <= 0:
            raise ValueError("ranks must be >= 1 and the reference times > 0")

    @property
    def factor(self) -> float:
        return self.now_s / self.profiled_s


def profiled_reference(cluster: "Cluster", ranks: int) -> dict[str, Any] | None:
    """The profile's side of the drift at ``ranks`` ranks on this host: ``{micro_batch, ranks,
    profiled_s, model_sha256}`` -- the micro-batch its contention reference ran at (the largest
    block point), the curve at ``ranks`` (autopar.profile_conditions.slowdown) and the model file
    the table belongs to -- or None when the profile has no CPU contention curve to compare with."""
    from autopar.profile_conditions import profile_conditions, slowdown

    cond = profile_conditions(cluster)
    m = cluster.measured
    if cond is None or cond.device_type != "cpu" or not cond.contention or m is None or m.layers is None:
        return None
    b = max((p.b for p in m.layers.regions.get("block", ())), default=None)
    if b is None:
        return None
    return {"micro_batch": b, "ranks": ranks, "profiled_s": slowdown(cond, ranks), "model_sha256": m.layers.model_sha256}


def time_reference_now(mf: "ModelFile", micro_batch: int, dtype: str, ranks: int) -> float:
    """This rank's median time of the reference, timed as the profile's curve times it at ``ranks``
    ranks on this machine (call it on every rank at once)."""
    from autopar.profiler.contention import reference_run, timed_run
    from autopar.profiler.cores import usable_cores

    run = reference_run(mf, micro_batch, dtype)
    for _ in range(2):
        run()
    cores = usable_cores()
    return statistics.median(timed_run(run, ranks, cores) for _ in range(REPEATS))
