"""The ranks of a plan rehearsed beside the cost model's prediction for their pipeline stage.

Both sides count the same thing: ``peak_bytes`` is the rehearsed step's peak of tensor bytes plus
the memory no tensor holds (the cluster profile's ``framework_reserve_bytes``: CUDA context,
communication buffers, allocator slack), as the cost model's ``peak_memory_bytes`` is its tensor
parts plus that reserve; ``fits`` is every rehearsed rank within the device's capacity. The
difference that tests the cost model is the tensor part's (``tensor_error_pct``): the reserve is
added equally to both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from autopar.errors import AutoparError

if TYPE_CHECKING:
    from autopar.cost.step import Estimate
    from autopar.plan import Plan

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class RankRehearsal:
    """One rank: rehearsed and predicted peak (bytes, reserve included) and their parts."""

    rank: int
    stage: int
    peak_bytes: float
    parts: dict[str, float]  # params, grads, optimizer, activations, temporaries, reserve
    predicted_peak_bytes: float
    predicted_parts: dict[str, float]  # the cost model's: params, grads, optimizer, activations, other
    reserve_bytes: float
    seconds: float
    microbatches: tuple[int, ...] = ()  # the rehearsed steps' micro-batches (rank.rehearsed_microbatches)
    host_bytes: float = 0.0  # what the rank keeps in host memory (offload), not in ``peak_bytes``
    origins: tuple = ()  # why.LiveGroup: the largest groups alive at the peak (``rehearse --why``)

    @property
    def tensor_error_pct(self) -> float:
        """(predicted - rehearsed) / rehearsed over the tensor bytes, in percent."""
        measured = self.peak_bytes - self.reserve_bytes
        return 100.0 * (self.predicted_peak_bytes - self.reserve_bytes - measured) / measured if measured else 0.0


@dataclass(frozen=True, kw_only=True)
class Rehearsal:
    """A plan's rehearsed ranks and the device they must fit."""

    ranks: tuple[RankRehearsal, ...]
    capacity_bytes: float
    cluster: str
    microbatches: int = 0  # the plan's micro-batches per step

    @property
    def fits(self) -> bool:
        return all(r.peak_bytes <= self.capacity_bytes for r in self.ranks)


def default_ranks(plan: "Plan") -> tuple[int, ...]:
    """The first rank of every pipeline stage (ranks are laid out [pp, dp, cp, tp])."""
    per_stage = plan.parallel.world_size // plan.parallel.pp
    return tuple(s * per_stage for s in range(plan.parallel.pp))


def check_ranks(plan: "Plan", ranks: Sequence[int]) -> tuple[int, ...]:
    world = plan.parallel.world_size
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise AutoparError(f"rank {bad[0]} is outside the plan's world of {world} ranks (0..{world - 1}); "
                           "choose --ranks within it")
    return tuple(dict.fromkeys(ranks))


def rehearse(plan: "Plan", model_path: str, estimate: "Estimate", cluster_name: str,
             ranks: Sequence[int] | None = None, progress: Any = None, workers: int | None = None,
             why: int = 0) -> Rehearsal:
    """Rehearse ``ranks`` of ``plan`` (default: ``default_ranks``) beside the cost model's
    ``estimate`` of it. Each rank runs in a process of its own (a fresh fake world: torch keeps
    process-group state per process), ``workers`` at a time (default: the CPU cores).
    ``progress(text)``: called as ranks start and finish. ``why`` > 0: each rank also names the
    ``why`` largest groups of tensors alive at its peak (autopar.rehearse.why). One-line
    AutoparError on bad input."""
    chosen = check_ranks(plan, default_ranks(plan) if ranks is None else ranks)
    reserve = estimate.reserve_bytes
    got = _rehearse_ranks(plan, model_path, chosen, progress, workers, why)
    out = []
    for r in chosen:
        m = got[r]
        stage = estimate.ranks[m.stage]
        parts = {k: v for k, v in m.parts.items() if k != "host"}
        out.append(RankRehearsal(rank=r, stage=m.stage, peak_bytes=m.peak_bytes + reserve,
                                 parts={**parts, "reserve": reserve}, predicted_peak_bytes=stage.peak_bytes,
                                 predicted_parts=dict(stage.memory_bytes), reserve_bytes=reserve, seconds=m.seconds,
                                 microbatches=m.microbatches, host_bytes=m.parts.get("host", 0.0),
                                 origins=m.origins))
    return Rehearsal(ranks=tuple(out), capacity_bytes=estimate.capacity_bytes, cluster=cluster_name,
                     microbatches=plan.num_microbatches)


def _rehearse_ranks(plan: "Plan", model_path: str, ranks: Sequence[int], progress: Any,
                    workers: int | None, why: int = 0) -> dict[int, Any]:
    """rank -> ``rank.RankMemory``. Every step (a rank at one micro-batch count) runs in a fresh
    process of its own (``rank.rehearse_step``; forked from a server with torch imported:
    rehearse/workers.py), ``workers`` at a time; the first error is raised."""
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from autopar.rehearse.rank import rank_memory, rehearsed_microbatches, with_microbatches
    from autopar.rehearse.workers import Caller, context, main_left_alone

    counts = rehearsed_microbatches(plan)
    tasks = [(r, m) for r in ranks for m in counts]
    n = max(1, min(len(tasks), workers or os.cpu_count() or 1))
    steps: dict[tuple[int, int], Any] = {}
    seconds: dict[int, float] = dict.fromkeys(ranks, 0.0)
    pool = ProcessPoolExecutor(max_workers=n, mp_context=context(), max_tasks_per_child=1)
    caller = Caller.here()
    with main_left_alone():  # the workers need nothing of a main module that is no file
        try:
            futures = {pool.submit(_step_in_process, with_microbatches(plan, m), model_path, r, why, caller): (r, m)
                       for r, m in tasks}
            if progress is not None:
                progress(f"rehearsing {len(ranks)} rank(s) ({len(tasks)} steps), {n} at a time")
            done = 0
            for fut in as_completed(futures):
                r, m = futures[fut]
                steps[(r, m)], took = fut.result()  # a step's one-line AutoparError ends the rehearsal
                seconds[r] += took
                if all((r, c) in steps for c in counts):
                    done += 1
                    if progress is not None:
                        progress(f"rank {r} done in {seconds[r]:.0f} s ({done}/{len(ranks)})")
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    return {r: rank_memory(plan, r, [steps[(r, m)] for m in counts], seconds[r]) for r in ranks}


def _step_in_process(plan: "Plan", model_path: str, rank: int, why: int = 0, caller: Any = None) -> tuple[Any, float]:
    import time
    import warnings

    if caller is not None:  # a forked worker: the caller's environment, directory and path (workers.py)
        caller.restore()

    from autopar.executor.runtime.checks import preflight
    from autopar.modelfile import load_model_file
    from autopar.rehearse.rank import rehearse_step

    warnings.filterwarnings("ignore")  # torch's module-tracker notes about its hooks: not the user's concern
    start = time.perf_counter()
    mf = load_model_file(model_path)
    spec, _warnings = preflight(plan, mf, plan.parallel.world_size)
    return rehearse_step(plan, mf, spec, rank, why), time.perf_counter() - start


def rehearsal_json(reh: Rehearsal) -> dict[str, Any]:
    """The ``rehearse --json`` object."""
    return {
        "ranks": [{"rank": r.rank, "stage": r.stage, "peak_bytes": r.peak_bytes,
                   "predicted_peak_bytes": r.predicted_peak_bytes, "tensor_error_pct": r.tensor_error_pct,
                   "parts": dict(r.parts), "predicted_parts": dict(r.predicted_parts), "seconds": r.seconds,
                   "rehearsed_microbatches": list(r.microbatches), "host_bytes": r.host_bytes,
                   **({"live_at_peak": [dataclasses.asdict(g) for g in r.origins]} if r.origins else {})}
                  for r in reh.ranks],
        "microbatches": reh.microbatches,
        "capacity_bytes": reh.capacity_bytes,
        "fits": reh.fits,
    }


def format_rehearsal(reh: Rehearsal) -> str:
    """The table ``autopar rehearse`` prints: per rank, rehearsed and predicted memory by part (GiB,
    or MiB when every rank's tensors are under 1 GiB: a small model's parts beside a GPU profile's
    reserve would read 0.00)."""
    from autopar.rehearse.why import format_groups
    from autopar.report import table

    unit, scale = ("GiB", GIB) if max(r.peak_bytes - r.reserve_bytes for r in reh.ranks) >= GIB else ("MiB", 2**20)
    parts = ("params", "grads", "optimizer", "activations", "temporaries")
    rows = []
    for r in reh.ranks:
        pred_other = r.predicted_parts.get("other", 0.0) - r.reserve_bytes
        pred = [r.predicted_parts.get(p, 0.0) for p in parts[:-1]] + [pred_other]
        rows.append([str(r.rank), str(r.stage)]
                    + [f"{r.parts[p] / scale:.2f} / {v / scale:.2f}" for p, v in zip(parts, pred)]
                    + [f"{r.reserve_bytes / scale:.2f}", f"{r.peak_bytes / scale:.2f}",
                       f"{r.predicted_peak_bytes / scale:.2f}", f"{r.tensor_error_pct:+.1f}", f"{r.seconds:.0f}"])
    head = ["rank", "stage", "params", "grads", "optimizer", "activations", "temporaries / other", "reserve",
            f"rehearsed {unit}", f"predicted {unit}", "error %", "s"]
    worst = max(reh.ranks, key=lambda r: r.peak_bytes)
    rehearsed = sorted({m for r in reh.ranks for m in r.microbatches})
    if rehearsed and rehearsed != [reh.microbatches]:
        steps = (f"{reh.microbatches} micro-batches per step, rehearsed with "
                 f"{' and '.join(map(str, rehearsed))} (rehearse.rank: the peak at {reh.microbatches} is the line "
                 "through them)" if len(rehearsed) > 1 else
                 f"{reh.microbatches} micro-batches per step, rehearsed with {rehearsed[0]} (its peak is reached by then)")
    else:
        steps = f"{reh.microbatches} micro-batches per step, all rehearsed"
    verdict = "fits" if reh.fits else "does NOT fit"
    why = "".join("\n\n" + format_groups(r.rank, r.origins, scale, unit) for r in reh.ranks if r.origins)
    return (table(head, rows)
            + f"\n\nparts: rehearsed / predicted {unit}; reserve: what no tensor holds (CUDA context, NCCL buffers), "
            + "added to both; error: the cost model's tensor bytes against the rehearsal's"
            + f"\n{steps}"
            + f"\npeak {_amount(worst.peak_bytes)} (rank {worst.rank}) of {_amount(reh.capacity_bytes)} "
            + f"on {reh.cluster}: the plan {verdict}" + why)


def _amount(nbytes: float) -> str:
    """Bytes in GiB, or MiB under 1 GiB (the verdict line: a device's capacity reads in GiB)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"
