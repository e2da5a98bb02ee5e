r"""The optimal contiguous partition of a layer chain over pipeline ranks: an exact dynamic program.

A chain model (no repeated block; graph.chain) has L units that differ in time, parameters and
activations, so the block-count ILP of search/ilp.py does not apply; the fallback (docs/design.md §6) is a
contiguous partition of the chain. With P ranks, rank r holding units [s_r, s_{r+1})
(0 = s_0 < s_1 < ... < s_P = L), a stage's cost depends only on (s_r, s_{r+1}, r):

    t(a, b, r)  one micro-batch's forward+backward on rank r     (time)
    z(a, b, r)  rank r's end-of-step tail                        (time)
    fits(a, b, r)  rank r's memory <= capacity

and the step time (cost/chain.py) is

    minimise   F(s) = (M - 1) max_r t_r + sum_r t_r + max_r z_r     subject to fits for every r.

F is a non-decreasing function of the three accumulated quantities (T = max t, S = sum t,
Z = max z), each built stage by stage with a monotone operator (max or +). So a prefix that ends
at unit b with r + 1 stages and triple (T, S, Z) is never worse to extend than one with a
component-wise larger triple: the dynamic program keeps, for each (r, b), the Pareto front of the
triples of all feasible prefixes,

    front(0, b)     = { (t, t, z) of stage [0, b) at rank 0 }                        if it fits
    front(r, b)     = Pareto{ (max(T, t), S + t, max(Z, z)) : a < b, (T, S, Z) in front(r-1, a),
                              t, z of [a, b) at rank r, [a, b) fits at rank r }
    optimum         = min over (T, S, Z) in front(P-1, L) of (M - 1) T + S + Z.

No dominated prefix can complete to a better partition, and every non-dominated one is kept, so
the minimum is exact (proved optimal, status OPTIMAL). Prefixes whose F already reaches a given
threshold (the search's k-th best plan) are dropped, since extending one only increases F; with a
lower bound R(b) on what the remaining stages add to S (their units' own times), a prefix is dropped
already when F(max(T, R(b) / stages left), S + R(b), Z) reaches it. Cost:
O(P L^2 |front|) stage evaluations and comparisons; fronts stay small because T and Z are maxima.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

StageCost = Callable[[int, int, int], "tuple[float, float] | None"]  # (a, b, rank) -> (t, z) or None


@dataclass(frozen=True, kw_only=True)
class Partition:
    """An optimal partition: ``ranges[r]`` = [start, end) of rank r, and its objective F."""

    ranges: tuple[tuple[int, int], ...]
    objective_s: float
    status: str = "OPTIMAL"

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.ranges)


def _pareto(items: list[tuple[float, float, float, int, int]]) -> list[tuple[float, float, float, int, int]]:
    """The non-dominated (T, S, Z, ...) entries (ties keep the first). Visited in increasing T, an
    entry is dominated iff an earlier one has S' <= S and Z' <= Z: a staircase of the earlier
    entries' (S, Z) (S increasing, Z decreasing) answers that with one bisection."""
    items.sort(key=lambda x: (x[0], x[1], x[2]))
    kept: list[tuple[float, float, float, int, int]] = []
    stair_s: list[float] = []
    stair_z: list[float] = []
    for it in items:
        _, S, Z = it[0], it[1], it[2]
        i = bisect.bisect_right(stair_s, S)
        if i and stair_z[i - 1] <= Z:
            continue
        kept.append(it)
        j = i
        while j < len(stair_s) and stair_z[j] >= Z:  # now dominated in (S, Z) for all later entries
            j += 1
        stair_s[i:j], stair_z[i:j] = [S], [Z]
    return kept


def optimal_partition(num_units: int, num_stages: int, num_microbatches: int, stage: StageCost,
                      threshold: float = math.inf, rest_s: Sequence[float] | None = None) -> Partition | None:
    """The partition minimising F (module docstring); None if none fits or none beats ``threshold``.

    ``rest_s[b]`` (optional, len L + 1): a lower bound on the time the stages after a prefix ending
    at unit b add together (e.g. the remaining units' own times). A prefix is dropped when
    F(max(T, rest / stages left), S + rest, Z) reaches ``threshold``: no completion can do better."""
    L, P, m1 = num_units, num_stages, num_microbatches - 1
    if not 1 <= P <= L:
        raise ValueError(f"cannot split {L} units over {P} stages")

    def objective(T: float, S: float, Z: float) -> float:
        return m1 * T + S + Z

    # fronts[r][b]: entries (T, S, Z, a, index into fronts[r-1][a]) of prefixes [0, b) on r+1 stages
    fronts: list[dict[int, list[tuple[float, float, float, int, int]]]] = []
    for r in range(P):
        level: dict[int, list[tuple[float, float, float, int, int]]] = {}
        prev = fronts[r - 1] if r else {0: [(0.0, 0.0, 0.0, -1, -1)]}
        b_lo, b_hi = r + 1, L - (P - 1 - r)
        b_range = range(b_hi, b_hi + 1) if r == P - 1 else range(b_lo, b_hi + 1)
        for b in b_range:
            cands: list[tuple[float, float, float, int, int]] = []
            for a, entries in prev.items():
                if a >= b:
                    continue
                cost = stage(a, b, r)
                if cost is None:
                    continue
                t, z = cost
                rest = rest_s[b] if rest_s is not None and r < P - 1 else 0.0
                share = rest / (P - 1 - r) if rest else 0.0
                for idx, (T, S, Z, _, _) in enumerate(entries):
                    new = (max(T, t), S + t, max(Z, z))
                    if objective(max(new[0], share), new[1] + rest, new[2]) < threshold:
                        cands.append((*new, a, idx))
            if cands:
                level[b] = _pareto(cands)
        if not level:
            return None
        fronts.append(level)
    final = fronts[P - 1].get(L)
    if not final:
        return None
    best = min(range(len(final)), key=lambda i: objective(*final[i][:3]))
    value = objective(*final[best][:3])
    bounds = [L]
    r, i = P - 1, best
    while r >= 0:
        _, _, _, a, idx = fronts[r][bounds[-1]][i]
        bounds.append(a if r else 0)
        r, i = r - 1, idx
    bounds.reverse()
    return Partition(ranges=tuple((bounds[k], bounds[k + 1]) for k in range(P)), objective_s=value)
