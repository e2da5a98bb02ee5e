"""Sweeps: plan every point of ``--gpus a,b,c`` x ``--global-batch ...`` x ``--seq-len ...`` and
put the best plan of each in one table, with the scaling efficiency against the first point.

Each point is exactly the single-point request (``driver.search_plans`` with the same arguments),
so a sweep row is the plan ``autopar plan`` would write for that point alone. Scaling efficiency is
tokens/s per GPU relative to the first point that has a plan (1.0 = perfect linear scaling).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

from autopar.errors import InfeasibleError
from autopar.report import gib, table
from autopar.search.driver import PlanSearch


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """One point of a sweep: its request and either its search or why nothing fits."""

    gpus: int
    global_batch: int | None  # None: the default for this many GPUs
    seq_len: int | None
    found: PlanSearch | None
    error: str | None

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        if self.found is None:
            return None
        return self.found.result.top[0].estimate.tokens_per_s / self.gpus


def sweep_points(gpus: Sequence[int], global_batches: Sequence[int | None], seq_lens: Sequence[int | None]
                 ) -> list[tuple[int, int | None, int | None]]:
    """The points of a sweep in order: GPUs outermost, then global batch, then sequence length."""
    return list(itertools.product(gpus, global_batches, seq_lens))


def run_sweep(points: Sequence[tuple[int, int | None, int | None]],
              plan_point: Callable[[int, int | None, int | None], PlanSearch]) -> list[SweepPoint]:
    """Plan each point with ``plan_point(gpus, global_batch, seq_len)``; a point nothing fits is
    recorded with its one-line reason and the sweep goes on."""
    out = []
    for n, batch, seq in points:
        try:
            found, error = plan_point(n, batch, seq), None
        except InfeasibleError as exc:
            found, error = None, str(exc)
        out.append(SweepPoint(gpus=n, global_batch=batch, seq_len=seq, found=found, error=error))
    return out


def plan_text(found: PlanSearch) -> str:
    """``dp 8 tp 8 pp 4 z1 mb 1 1f1b selective``: the layout of the best plan of a point."""
    c = found.result.top[0].config
    parts = [f"dp{c.dp}", f"tp{c.tp}", f"pp{c.pp}"]
    if c.cp > 1:
        parts.append(f"cp{c.cp} {c.cp_kind}")
    if c.ep > 1:  # expert parallelism
        parts.append(f"ep{c.ep}")
    if c.tp > 1 and c.sequence_parallel:
        parts.append("sp")
    parts += [f"z{c.zero}", f"mb{c.micro_batch}"]
    if c.pp > 1:
        parts.append(f"int v{c.virtual_stages}" if c.schedule == "interleaved-1f1b" else c.schedule)
    parts.append(c.recompute)
    return " ".join(parts)


def sweep_report(points: Sequence[SweepPoint]) -> str:
    """The sweep table: one row per point."""
    base = next((p.tokens_per_s_per_gpu for p in points if p.found is not None), None)
    rows = []
    for p in points:
        if p.found is None:
            reason = (p.error or "").split(":", 1)[0]
            rows.append((p.gpus, p.global_batch or "-", p.seq_len or "-", reason, "-", "-", "-", "-", "-"))
            continue
        space, best = p.found.space, p.found.result.top[0]
        e = best.estimate
        eff = p.tokens_per_s_per_gpu / base if base else float("nan")
        rows.append((p.gpus, space.global_batch, space.seq_len, plan_text(p.found), f"{e.step_time_s:,.3f}",
                     f"{e.tokens_per_s:,.0f}", f"{e.mfu * 100:.1f}", gib(e.peak_memory_bytes), f"{eff * 100:.1f}"))
    return table(["GPUs", "global batch", "seq", "best plan", "step s", "tokens/s", "MFU %", "peak GiB",
                  "scaling %"], rows, align="rrrlrrrrr")
