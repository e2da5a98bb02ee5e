"""The predicted pipeline schedule of a plan, simulated, as a Chrome / Perfetto trace.

Durations come from the cost model (``cost.stage.StageTerms``): chunk c holding n_c blocks takes

    forward  n_c * block.fwd_s + [c first] pre.fwd_s + [c last] post.fwd_s
    backward n_c * block.bwd_s + [c first] pre.bwd_s + [c last] post.bwd_s   (recompute included:
             the first n_c * block.recompute_s of it is drawn as its own "recompute" event)

and after a forward of a chunk that is not the last (or a backward of one that is not the first)
the rank spends ``p2p_s`` sending the activation (gradient) to the next (previous) chunk's rank, as
the step model charges it. Each pipeline rank runs its operations in the order of the plan's
schedule; an operation starts when the rank is free and its input has arrived:

    F(c, m) waits for F(c-1, m) and its send;  B(c, m) waits for B(c+1, m) and its send
    (B(last, m) follows F(last, m) on the same rank).

The bubble is not drawn from a formula: it is whatever idle time the simulation leaves. Orders:

    gpipe             F(0..M-1) then B(0..M-1)
    1f1b              rank r: w = min(p-r-1, M) forwards, then (F, B) pairs, then w backwards
    interleaved-1f1b  Megatron's order over M·v virtual micro-batches k: forward k runs local chunk
                      (k // p) % v of micro-batch (k // pv)·p + k % p, backward k local chunk
                      v-1-(k // p) % v; warm-up min(Mv, 2(p-r-1) + (v-1)p) (all Mv if M = p)

After its last backward every rank runs its step tail (gradient sync, optimizer: ``RankCost.tail_s``).
Trace Event Format: complete events (``ph: "X"``, microseconds), pid 0 = the job, tid r = pipeline
rank r, with process/thread name metadata, so it opens in Perfetto or chrome://tracing next to
the measured ``torch.profiler`` trace of ``autopar run --trace``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.cost.stage import StageTerms
from autopar.cost.step import Estimate
from autopar.errors import AutoparError
from autopar.plan import Plan


@dataclass(frozen=True, kw_only=True)
class Op:
    """One scheduled operation on a pipeline rank: forward or backward of chunk ``chunk`` (global
    chunk index) for micro-batch ``microbatch``."""

    kind: str  # "F" | "B"
    chunk: int
    microbatch: int


@dataclass(frozen=True, kw_only=True)
class Event:
    """One simulated interval on a pipeline rank (seconds from the step start)."""

    rank: int
    category: str  # forward | recompute | backward | p2p | tail
    name: str
    start_s: float
    duration_s: float
    chunk: int | None = None
    microbatch: int | None = None

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True, kw_only=True)
class Timeline:
    events: tuple[Event, ...]
    pipeline_s: float  # end of the last backward (incl. its send)
    step_s: float  # end of the last tail

    def busy_s(self, rank: int) -> float:
        return sum(e.duration_s for e in self.events if e.rank == rank and e.category != "tail")


def schedule_order(schedule: str, pp: int, rank: int, num_microbatches: int, virtual_stages: int = 1) -> list[Op]:
    """The order in which pipeline rank ``rank`` runs its forwards and backwards (module docstring)."""
    m, p, v = num_microbatches, pp, virtual_stages
    if schedule == "gpipe" or p == 1:
        return [Op(kind="F", chunk=rank, microbatch=i) for i in range(m)] + \
               [Op(kind="B", chunk=rank, microbatch=i) for i in range(m)]
    if schedule == "1f1b":
        fwd = [Op(kind="F", chunk=rank, microbatch=i) for i in range(m)]
        bwd = [Op(kind="B", chunk=rank, microbatch=i) for i in range(m)]
        return _one_f_one_b(fwd, bwd, min(p - rank - 1, m))
    if schedule == "interleaved-1f1b":
        total = m * v

        def op(kind: str, k: int) -> Op:
            local = (k // p) % v
            if kind == "B":
                local = v - 1 - local
            return Op(kind=kind, chunk=local * p + rank, microbatch=(k // (p * v)) * p + k % p)

        warmup = total if m == p else min(total, 2 * (p - rank - 1) + (v - 1) * p)
        return _one_f_one_b([op("F", k) for k in range(total)], [op("B", k) for k in range(total)], warmup)
    raise AutoparError(f"unknown pipeline schedule {schedule!r}")


def _one_f_one_b(fwd: list[Op], bwd: list[Op], warmup: int) -> list[Op]:
    order = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[len(fwd) - warmup:]


def chunk_modes(plan: Plan) -> list[dict[str, int]] | None:
    """Per-stage recompute: per chunk, its blocks under each recompute mode (``Plan.block_recompute``'s rule);
    None for a plan without ``recompute_blocks``."""
    if plan.parallel.recompute_blocks is None:
        return None
    modes = plan.block_recompute()
    out = []
    for start, end in plan.stage_ranges():
        counts: dict[str, int] = {}
        for b in range(start, end):
            counts[modes[b]] = counts.get(modes[b], 0) + 1
        out.append(counts)
    return out


def chunk_times(terms: StageTerms, chunk_blocks: list[int],
                modes: list[dict[str, int]] | None = None) -> list[tuple[float, float, float]]:
    """(forward_s, backward_s incl. recompute, recompute_s) of one micro-batch per chunk; ``modes``
    (``chunk_modes``) prices each chunk's blocks by their recompute mode (a "mixed" config's terms)."""
    last = len(chunk_blocks) - 1
    out = []
    for c, n in enumerate(chunk_blocks):
        if modes is None or terms.recompute_parts is None:
            f, b, rc = n * terms.block.fwd_s, n * terms.block.bwd_s, n * terms.block.recompute_s
        else:
            parts = [(k, terms.recompute_parts[m]) for m, k in modes[c].items()]
            f, b, rc = (sum(k * getattr(p, name) for k, p in parts) for name in ("fwd_s", "bwd_s", "recompute_s"))
        if c == 0:
            f, b = f + terms.pre.fwd_s, b + terms.pre.bwd_s
        if c == last:
            f, b = f + terms.post.fwd_s, b + terms.post.bwd_s
        out.append((f, b, rc))
    return out


# A trace holds about 3 events per forward/backward (plus sends and recompute) at ~150 bytes of JSON
# each: 500,000 forwards and backwards is a ~200 MB file, as much as Perfetto opens comfortably.
MAX_TRACE_OPS = 500_000


def check_trace_size(plan: Plan) -> int:
    """The number of forward/backward operations the trace would hold; one-line AutoparError when
    it is above MAX_TRACE_OPS (``explain --trace`` grew without bound with the micro-batch count)."""
    par = plan.parallel
    ops = 2 * par.pp * plan.num_microbatches * par.pp_virtual_stages
    if ops > MAX_TRACE_OPS:
        raise AutoparError(
            f"--trace would hold {ops:,} forward/backward events (2 x pp {par.pp} x {plan.num_microbatches:,} "
            f"micro-batches x {par.pp_virtual_stages} virtual stages), more than {MAX_TRACE_OPS:,}; trace a plan "
            "with fewer micro-batches (a larger micro_batch_size or a smaller global batch)")
    return ops


def simulate(plan: Plan, terms: StageTerms, estimate: Estimate | None = None) -> Timeline:
    """Run the plan's schedule with the cost model's durations (see the module docstring).
    Bounded: at most MAX_TRACE_OPS operations (check_trace_size)."""
    check_trace_size(plan)
    par = plan.parallel
    p, m = par.pp, plan.num_microbatches
    chunk_blocks = [end - start for start, end in plan.stage_ranges()]
    times = chunk_times(terms, chunk_blocks, chunk_modes(plan))
    last = len(chunk_blocks) - 1
    p2p = terms.p2p_s if p > 1 else 0.0
    orders = [schedule_order(par.pp_schedule, p, r, m, par.pp_virtual_stages) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, chunk, mb) -> time its output is at the consumer
    free = [0.0] * p
    nxt = [0] * p
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                op = orders[r][nxt[r]]
                dep = _dependency(op, last)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done.get(dep, 0.0) if dep else 0.0)
                free[r] = _run(op, r, start, times[op.chunk], p2p, last, events)
                done[(op.kind, op.chunk, op.microbatch)] = free[r]
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # an order that waits on itself: a bug in schedule_order, not user input
            raise AssertionError(f"pipeline schedule {par.pp_schedule} deadlocked in the simulation")
    pipeline = max(free)
    tails = [rk.tail_s for rk in estimate.ranks] if estimate is not None else [0.0] * p
    for r in range(p):
        if tails[r] > 0:
            events.append(Event(rank=r, category="tail", name="grad sync + optimizer", start_s=free[r],
                                duration_s=tails[r]))
    step = max(free[r] + tails[r] for r in range(p))
    return Timeline(events=tuple(events), pipeline_s=pipeline, step_s=step)


def _dependency(op: Op, last: int) -> tuple[str, int, int] | None:
    if op.kind == "F":
        return ("F", op.chunk - 1, op.microbatch) if op.chunk > 0 else None
    if op.chunk == last:
        return ("F", op.chunk, op.microbatch)
    return ("B", op.chunk + 1, op.microbatch)


def _run(op: Op, rank: int, start: float, chunk_time: tuple[float, float, float], p2p: float, last: int,
         events: list[Event]) -> float:
    """Append the events of ``op`` starting at ``start``; return when the rank is free again."""
    fwd, bwd, rc = chunk_time
    t = start
    tag = f"mb{op.microbatch} c{op.chunk}"
    if op.kind == "F":
        events.append(Event(rank=rank, category="forward", name=f"F {tag}", start_s=t, duration_s=fwd,
                            chunk=op.chunk, microbatch=op.microbatch))
        t += fwd
        send = op.chunk < last
    else:
        if rc > 0:
            events.append(Event(rank=rank, category="recompute", name=f"R {tag}", start_s=t, duration_s=rc,
                                chunk=op.chunk, microbatch=op.microbatch))
            t += rc
        events.append(Event(rank=rank, category="backward", name=f"B {tag}", start_s=t, duration_s=bwd - rc,
                            chunk=op.chunk, microbatch=op.microbatch))
        t += bwd - rc
        send = op.chunk > 0
    if send and p2p > 0:
        what = "send activation" if op.kind == "F" else "send gradient"
        events.append(Event(rank=rank, category="p2p", name=f"{what} {tag}", start_s=t, duration_s=p2p,
                            chunk=op.chunk, microbatch=op.microbatch))
        t += p2p
    return t


def trace_json(plan: Plan, timeline: Timeline, *, title: str = "autopar predicted") -> dict[str, Any]:
    """The Trace Event Format object: {"traceEvents": [...], "displayTimeUnit": "ms", ...}."""
    par = plan.parallel
    stride = par.dp * par.cp * par.tp
    meta: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": f"{title}: {plan.model.file}"}},
    ]
    for r in range(par.pp):
        meta.append({"ph": "M", "pid": 0, "tid": r, "name": "thread_name",
                     "args": {"name": f"stage {r} (ranks {r * stride}-{(r + 1) * stride - 1})"}})
        meta.append({"ph": "M", "pid": 0, "tid": r, "name": "thread_sort_index", "args": {"sort_index": r}})
    events = []
    for e in sorted(timeline.events, key=lambda e: (e.rank, e.start_s)):
        args: dict[str, Any] = {}
        if e.microbatch is not None:
            args = {"microbatch": e.microbatch, "chunk": e.chunk}
        events.append({"ph": "X", "pid": 0, "tid": e.rank, "cat": e.category, "name": e.name,
                       "ts": round(e.start_s * 1e6, 3), "dur": round(e.duration_s * 1e6, 3), "args": args})
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "autopar explain --trace", "schedule": par.pp_schedule,
                      "pp": par.pp, "virtual_stages": par.pp_virtual_stages,
                      "microbatches": plan.num_microbatches,
                      "pipeline_s": timeline.pipeline_s, "step_s": timeline.step_s},
    }
