r"""The inner problem: split L repeated blocks over pipeline chunks, as a CP-SAT integer program.

For one configuration (``StageTerms``: pp ranks, v chunks per rank, C = pp * v chunks, chunk c on
rank r(c) = c mod pp, M micro-batches), with per-block coefficients tau (forward+backward time of
one micro-batch), beta (its backward part), pi (parameters on a rank), alpha (activation bytes per
in-flight micro-batch), sigma (model-state bytes per parameter) and I_r the in-flight micro-batches
of rank r:

    variables   N_r in {v..L}  (blocks on pipeline rank r),   T >= 0,   Z >= 0

    minimise    (M - 1/v) T + (1/v) sum_r t_r + Z      (solved as v times this, in integers)

    where       t_r   = tau  N_r + f_r          (f_r: embedding on rank 0, head + loss on the last
                                                 chunk's rank, point-to-point sends of its chunks)
                b_r   = beta N_r + g_r          (backward of one micro-batch: the overlap window)
                P_r   = pi   N_r + p_r          (parameters held by rank r)

    subject to  sum_r N_r = L                                       (blocks)
                T >= t_r                              for all r     (slowest stage)
                Z >= floor + (c sync + gather + opt) P_r        for all r  (tail: last bucket, update)
                Z >= ((1 + c) sync + gather + opt) P_r - b_r  for all r  (tail: unhidden gradient sync)
                sigma P_r + g_w W_r - g_o N_r + max_s sum_k s_k A_{r,k} + other <= capacity  (memory)
                sum_{r on node} G (h_s P_r + I_r h_a N_r) <= H        for every node  (host memory)

The memory family: s runs over the states of the schedule (s_k micro-batches in flight on the
rank's local chunk k; cost.memory.inflight_states: one state, I_r, for 1F1B and GPipe) and A_{r,k}
is what one micro-batch of chunk k saves, alpha times its blocks (N_r dealt as below) plus the
embedding's a_r on rank 0's first chunk. W_r counts the blocks of rank r's K largest chunks, the
pipelining runtime's gather window (interleaved 1F1B with v > 3, StageTerms.window): at ZeRO-1/2
only the three chunks in it hold their 16-bit parameters (K = 3, g_w = g_o = one block's, less
than sigma pi), at ZeRO-3 two whole chunks wait gathered ahead of their turn (K = 2, g_w one
block's, g_o = 0); 0 elsewhere. The family is non-decreasing in N_r, so it is a cap on N_r
(``block_capacities``).

The host family exists only with host offload: h_s model-state bytes per parameter and h_a
activation bytes per block kept on the host, G GPUs of each pipeline rank on the node, H its host
memory (``cost.host.host_family``). A node holding one pipeline rank's GPUs makes it a cap on N_r
like the memory family; a node holding k consecutive ranks makes it one row over the k. Every
block counts one in a row, so the most blocks a row's ranks can hold within given ranges is found by
filling the cheapest rank first: the parametric method's sum test stays exact. ``enumerate``
checks a row as it fixes the row's last rank.

A rank's N_r blocks are dealt to its v chunks as evenly as possible (sizes differ by at most one),
the larger chunks last -- the first chunks hold the most micro-batches in flight (cost.memory), so
that arrangement keeps the least activations whatever the recompute mix --
because the fill/drain term sum_r t_r / v assumes a rank's chunks take equal time; the split is
uneven across ranks, where it pays off (embedding and head, 1F1B in-flight memory). Every cost term
depends on the chunks only through N_r, so the ILP needs one variable per rank, not per chunk,
and its size does not grow with the number of blocks or virtual stages.

This is exactly ``cost.step.evaluate`` for a split: the step time is linear in the n_c except for
two maxima, which the epigraph variables T and Z represent exactly because they are minimised.
(c: the share of a hidden collective that contention still costs). Without overlap of the gradient
sync, c is not charged and the tail is one family, Z >= (sync + gather + opt) P_r (no floor: the
whole sync is exposed, its last bucket with it).

Integers: times are scaled so that one micro-batch of the whole model -- every block, the embedding
and head, and the 2 C point-to-point transfers of its C chunks -- is 1e6 units (TIME_UNITS, in
``SplitILP.ns`` units per second), a resolution of one part in 1e6 whatever the model size, with
coefficients far from int64 overflow; bytes stay bytes (coefficients rounded up, capacity rounded down, so a split
the ILP accepts always fits). The reported step time is the float ``evaluate`` of the split the
solver returns. T and Z get the tightest upper bounds known (all blocks on one rank).

Three exact solvers of this one program (same integer coefficients, same objective, same cost
model), each provably optimal. ``SplitILP.solve`` walks small programs (``enumerate``) and gives
every other one to CP-SAT, the project's ILP solver; ``parametric`` runs on request
(``method="parametric"``) and cross-checks the other two in the tests:

- ``enumerate`` -- a program with at most MAX_ENUMERATED_SPLITS feasible block-count vectors
  (N_0..N_{pp-1}), e.g. the 35 ways to put 8 blocks on 4 ranks: every split is walked and
  evaluated exactly, from the greedy split (each block to the rank that stays fastest), dropping
  a prefix only when a lower bound of its objective already reaches the best found (so the walk
  stays exhaustive). Milliseconds, and it cannot stall, where CP-SAT's 2-worker portfolio was
  measured taking up to 3.3 s on such programs.
- ``parametric`` -- on request: for fixed values of the two maxima T and Z each rank's
  feasible block counts form an interval, so feasibility is a sum test; the optimum has T equal
  to some t_r(n) and Z to some z_r(n), and the search walks T upwards, bisecting for the least
  feasible Z, until wT T + wZ (least Z of all) reaches the best value. Polynomial (about
  pp L log(pp L) steps per T tried), well under a millisecond for GPT-3's programs.
- CP-SAT (OR-Tools) -- every program with more than MAX_ENUMERATED_SPLITS splits (and on
  request, ``method="cp-sat"``): it proves its optimum (status OPTIMAL, objective == bound) or
  reports FEASIBLE at its time limit.

``SplitSolution.method`` says which solved it; the status is OPTIMAL only for a proven optimum.
ortools is imported only when CP-SAT runs. The tests check the three against each other and
against an exhaustive evaluation of every split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from autopar.cost.evolve import evolve
from autopar.cost.host import HostFamily
from autopar.cost.memory import InflightTable, dealt_sizes, inflight_table, loss_inflight_microbatches, most_blocks
from autopar.cost.stage import StageTerms
from autopar.cost.step import chunk_rank

# Two workers: CP-SAT's portfolio pairs a search worker with an LP-based one, which proves these
# programs optimal in milliseconds where a single default worker can stall for seconds on the wide
# T and Z domains of large programs (measured on the search-time benchmark). The same pairing was
# seen to stall for seconds on small programs, which is why CP-SAT is the last resort (see the
# module docstring). The optimum is unique in value; between equally fast splits any may be returned.
SOLVER_PARAMETERS: dict[str, object] = {"num_workers": 2}
TIME_UNITS = 1e6  # one micro-batch's total work is 1e6 integer time units (resolution 1e-6 of it)
# Programs with at most this many feasible block counts (N_0..N_{pp-1}) are solved by walking all
# of them in the same integer objective (``enumerate``): exact, and milliseconds (3,876 splits of
# 20 blocks over 5 ranks: 2-60 ms on the loaded 2-core machine, where CP-SAT took 3.2 s).
MAX_ENUMERATED_SPLITS = 4096
# The parametric search declines programs with more candidate values of the two maxima than this
# (pp x L for T, as many for Z).
MAX_PARAMETRIC_VALUES = 200_000


def run_cp_sat(model: Any, time_limit_s: float, parameters: dict[str, object]) -> tuple[Any, str, bool]:
    """Solve a CP-SAT ``model`` under a time limit and ``parameters``: (the solver, its status name,
    whether a solution was found: OPTIMAL or FEASIBLE). ortools is imported here, when CP-SAT runs."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    for key, value in parameters.items():
        setattr(solver.parameters, key, value)
    status = solver.Solve(model)
    return solver, solver.StatusName(status), status in (cp_model.OPTIMAL, cp_model.FEASIBLE)


@dataclass(frozen=True, kw_only=True)
class SplitSolution:
    """The split program's answer for one configuration."""

    chunk_blocks: tuple[int, ...] | None  # None: no split fits memory
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN
    objective_s: float
    bound_s: float
    method: str = "cp-sat"  # which exact solver answered: "enumeration", "parametric" or "cp-sat"


class SplitILP:
    """The program in the module docstring: integer coefficients once, then either every feasible
    split evaluated (small programs) or CP-SAT (one method per constraint family)."""

    def __init__(self, terms: StageTerms, num_blocks: int, host: HostFamily | None = None,
                 gpu_caps: Sequence[int] | None = None) -> None:
        """``gpu_caps``: ``rank_block_capacity(terms)`` when the caller has it already."""
        self.terms = terms
        # The nodes' host memory (offload) as rows of the program, so the split chosen is
        # the best one that fits the host too; one-rank rows are block caps like the GPU's.
        self.host = host
        self.host_rows = host.shared_rows if host is not None else ()
        self.cfg = terms.config
        self.L = num_blocks
        self.C = self.cfg.pp * self.cfg.virtual_stages
        self.ranks = range(self.cfg.pp)
        self.last_rank = chunk_rank(self.C - 1, self.cfg.pp)
        t = terms
        everything = num_blocks * t.block.time_s + t.pre.time_s + t.post.time_s + 2 * self.C * t.p2p_s
        params = num_blocks * t.block.params + t.pre.params + t.post.params + t.tied_params
        self.tail_s = t.grad_sync_floor_s + params * (t.grad_sync_s_per_param + t.after_sync_s_per_param)
        self.everything_s = everything
        self.ns = TIME_UNITS / max(everything, 1e-12)  # integer time units per second
        self.caps = list(rank_block_capacity(terms) if gpu_caps is None else gpu_caps)
        if host is not None:
            self.caps = [min(a, b) for a, b in zip(self.caps, host.rank_caps(self.cfg.pp, self.cfg.virtual_stages))]
        self._bounds_memo: list[tuple[int, int]] | None = None
        self.tau_ns = round(t.block.time_s * self.ns)
        self._count_memo: dict[int, int] = {}
        self.fixed_ns = self._fixed_times_ns()
        self.tail_rows = [self._tail_rows(r) for r in self.ranks]  # [(const, coeff), ...] per rank
        m, v = self.cfg.num_microbatches, self.cfg.virtual_stages
        self.t_weight, self.z_weight = m * v - 1, v
        # sum_r t_r = tau * L + sum_r f_r is a constant; kept so the objective is the step time.
        # Multiplied by v so (M - 1/v) stays an integer coefficient.
        self.constant_ns = self.tau_ns * self.L + sum(self.fixed_ns)

    # -- coefficients ------------------------------------------------------------------------
    def _fixed_times_ns(self) -> list[int]:
        """f_r per rank: the point-to-point sends of its chunks (two per chunk but the first and
        the last, which send once), the embedding on rank 0, head and loss on the last chunk's."""
        t, last, pp = self.terms, self.C - 1, self.cfg.pp
        f = [0.0] * pp
        if pp > 1:
            for c in range(self.C):
                f[chunk_rank(c, pp)] += t.p2p_s * ((c < last) + (c > 0))
        f[0] += t.pre.time_s
        f[self.last_rank] += t.post.time_s
        return [round(x * self.ns) for x in f]

    def _fixed_params(self, r: int) -> float:
        t = self.terms
        return (t.pre.params if r == 0 else 0.0) + (t.post.params + t.tied_params if r == self.last_rank else 0.0)

    def _fixed_bwd_s(self, r: int) -> float:
        t = self.terms
        return (t.pre.bwd_s if r == 0 else 0.0) + (t.post.bwd_s if r == self.last_rank else 0.0)

    def _tail_rows(self, r: int) -> list[tuple[int, int]]:
        """The tail family of rank r as integer (constant, coefficient of N_r) pairs: Z >= each."""
        t = self.terms
        sync_ns = t.grad_sync_s_per_param * self.ns
        per_param_ns = t.after_sync_s_per_param * self.ns
        if t.grad_sync_overlaps:
            per_param_ns += t.overlap_cost_fraction * sync_ns  # a hidden sync still costs its share c
        fixed_p = self._fixed_params(r)
        if not t.grad_sync_overlaps:
            # Z >= (sync + gather + opt) P_r: the whole sync runs after backward, its last bucket
            # included (cost.step.evaluate charges no floor here; a floor row would overstate Z)
            return [(round((sync_ns + per_param_ns) * fixed_p), round((sync_ns + per_param_ns) * t.block.params))]
        # Z >= floor + (gather + opt) P_r
        rows = [(round(t.grad_sync_floor_s * self.ns + per_param_ns * fixed_p), round(per_param_ns * t.block.params))]
        # Z >= (sync + gather + opt) P_r - b_r
        rows.append((round((sync_ns + per_param_ns) * fixed_p - self._fixed_bwd_s(r) * self.ns),
                     round((sync_ns + per_param_ns) * t.block.params - t.block.bwd_s * self.ns)))
        return rows

    def _bounds(self) -> list[tuple[int, int]]:
        """Each rank's block range: its v chunks at least, memory and the other ranks' minimum at most
        (computed once: the parametric walk asks for it tens of thousands of times)."""
        if self._bounds_memo is None:
            v = self.cfg.virtual_stages
            top = self.L - (self.cfg.pp - 1) * v
            self._bounds_memo = [(v, min(cap, top)) for cap in self.caps]
        return self._bounds_memo

    def _objective(self, n: tuple[int, ...] | list[int]) -> int:
        """The integer objective v * (step time) - constant of block counts ``n`` (max(T) and max(Z) at equality)."""
        t_max = max(self.tau_ns * n[r] + self.fixed_ns[r] for r in self.ranks)
        z_max = max(0, max(c + k * n[r] for r in self.ranks for c, k in self.tail_rows[r]))
        return self.t_weight * t_max + self.z_weight * z_max

    # -- direct solution of small programs -----------------------------------------------------
    def count_splits(self, limit: int = MAX_ENUMERATED_SPLITS) -> int:
        """How many block counts satisfy the bounds and sum to L (counting stops past ``limit``)."""
        if limit not in self._count_memo:
            self._count_memo[limit] = self._count_splits(limit)
        return self._count_memo[limit]

    def _count_splits(self, limit: int) -> int:
        L, bounds = self.L, self._bounds()
        spare = L - sum(lo for lo, _ in bounds)
        if spare >= 0 and all(hi - lo >= spare for lo, hi in bounds):
            # No upper bound binds: the compositions of the spare blocks over pp ranks.
            return min(limit + 1, math.comb(spare + len(bounds) - 1, len(bounds) - 1))
        # ways[s]: vectors of the ranks so far summing to s (capped at limit + 1: a capped term
        # keeps every sum it enters capped, so "more than limit" stays exact). One window sum of
        # prefix sums per rank: O(pp L) instead of O(pp L^2), as numpy array operations (int64:
        # the prefix sums stay below (limit + 1) (L + 1)). numpy comes with ortools.
        import numpy as np

        s = np.arange(L + 1)
        ways = np.zeros(L + 1, dtype=np.int64)
        ways[0] = 1
        for lo, hi in bounds:
            prefix = np.concatenate(([0], np.cumsum(ways)))
            window = prefix[np.clip(s - lo + 1, 0, L + 1)] - prefix[np.clip(s - hi, 0, L + 1)]
            ways = np.minimum(limit + 1, np.where(s >= lo, np.maximum(window, 0), 0))  # hi < lo: none
        return int(ways[L])

    def _splits(self) -> Iterator[tuple[int, ...]]:
        bounds = self._bounds()
        rest_lo = [sum(lo for lo, _ in bounds[r:]) for r in range(len(bounds) + 1)]
        rest_hi = [sum(hi for _, hi in bounds[r:]) for r in range(len(bounds) + 1)]

        def walk(r: int, left: int, prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
            if r == len(bounds):
                if left == 0:
                    yield prefix
                return
            lo, hi = bounds[r]
            for n in range(max(lo, left - rest_hi[r + 1]), min(hi, left - rest_lo[r + 1]) + 1):
                yield from walk(r + 1, left - n, prefix + (n,))

        yield from walk(0, self.L, ())

    def _greedy(self) -> tuple[int, ...] | None:
        """A feasible split to start from: every rank at its minimum, then each further block to
        the rank whose t_r would stay lowest (the split that minimises the slowest stage)."""
        bounds = self._bounds()
        n = [lo for lo, _ in bounds]
        left = self.L - sum(n)
        if left < 0 or any(lo > hi for lo, hi in bounds) or left > sum(hi - lo for lo, hi in bounds):
            return None
        for _ in range(left):
            r = min((r for r in self.ranks if n[r] < bounds[r][1]),
                    key=lambda r: self.tau_ns * (n[r] + 1) + self.fixed_ns[r])
            n[r] += 1
        return tuple(n)

    def enumerate(self, node_budget: int | None = None) -> SplitSolution | None:
        """Every feasible split, walked in lexicographic order of the block counts and evaluated
        in the program's own integer objective; the least is provably optimal.

        The walk starts from the greedy split's objective, carries the running maxima of the T and
        Z families down the ranks, and drops a prefix once a lower bound of its objective -- those
        maxima, T raised to the fewest blocks the busiest remaining rank must take and to every
        later rank's least t, Z to every later rank's least z -- reaches the best found: nothing below
        it can be better, so the walk stays exhaustive. With
        ``node_budget`` it gives up (returns None) after visiting that many prefixes."""
        bounds = self._bounds()
        k = len(bounds)
        rest_lo = [sum(lo for lo, _ in bounds[r:]) for r in range(k + 1)]
        rest_hi = [sum(hi for _, hi in bounds[r:]) for r in range(k + 1)]
        min_fixed_rest = [min(self.fixed_ns[r:], default=0) for r in range(k + 1)]
        tau, fixed, rows = self.tau_ns, self.fixed_ns, self.tail_rows
        # What every later rank costs at least, whatever it gets: t at its fewest blocks, and the
        # least z over its whole range (z is convex in n: max of affine pieces).
        t_least = [tau * lo + fixed[r] for r, (lo, _) in enumerate(bounds)]
        z_least = [min((max(c + kk * n for c, kk in rows[r]) for n in range(lo, hi + 1)), default=0)
                   for r, (lo, hi) in enumerate(bounds)]
        t_rest = [max(t_least[r:], default=0) for r in range(k + 1)]
        z_rest = [max(z_least[r:], default=0) for r in range(k + 1)]
        wt, wz = self.t_weight, self.z_weight
        seed = self._greedy()
        if seed is not None and self.host is not None and not self.host.holds(seed):
            seed = None
        # A host row (several ranks on one node) is checked as its last rank is given blocks.
        closes: list[tuple[tuple[int, ...], tuple[int, ...], int] | None] = [None] * k
        for row in self.host_rows:
            closes[row[0][-1]] = row
        best: list = [self._objective(seed), seed] if seed is not None else [None, None]
        counts = [0] * k
        visits = [0]

        class _OutOfBudget(Exception):
            pass

        def walk(r: int, left: int, t_max: int, z_max: int) -> None:
            if r == k:
                value = wt * t_max + wz * z_max
                if best[0] is None or value < best[0]:
                    best[0], best[1] = value, tuple(counts)
                return
            visits[0] += 1
            if node_budget is not None and visits[0] > node_budget:
                raise _OutOfBudget
            lo, hi = bounds[r]
            after = k - r - 1
            for n in range(max(lo, left - rest_hi[r + 1]), min(hi, left - rest_lo[r + 1]) + 1):
                t = max(t_max, tau * n + fixed[r])
                z = max(z_max, max(c + kk * n for c, kk in rows[r]))
                t_lb = t if after == 0 else max(t, tau * -(-(left - n) // after) + min_fixed_rest[r + 1],
                                                t_rest[r + 1])
                if best[0] is not None and wt * t_lb + wz * max(z, z_rest[r + 1]) >= best[0]:
                    continue
                counts[r] = n
                row = closes[r]
                if row is not None and not HostFamily.row_holds(row, counts):
                    continue
                walk(r + 1, left - n, t, z)

        try:
            walk(0, self.L, 0, 0)
        except _OutOfBudget:
            return None
        if best[1] is None:
            return SplitSolution(chunk_blocks=None, status="INFEASIBLE", objective_s=math.inf, bound_s=math.inf,
                                 method="enumeration")
        value_s = (best[0] + self.constant_ns) / (self.ns * self.cfg.virtual_stages)
        return SplitSolution(chunk_blocks=deal_chunks(list(best[1]), self.cfg.virtual_stages), status="OPTIMAL",
                             objective_s=value_s, bound_s=value_s, method="enumeration")

    def _z_interval(self, r: int, z: int) -> tuple[float, float]:
        """The block counts of rank r whose tail terms all stay <= z (an interval: each is affine)."""
        lo, hi = -math.inf, math.inf
        for c, k in self.tail_rows[r]:
            if k > 0:
                hi = min(hi, (z - c) // k)
            elif k < 0:
                lo = max(lo, -((z - c) // -k))  # n >= (z - c) / k, k < 0: ceil((c - z) / -k)
            elif c > z:
                return 1.0, 0.0
        return lo, hi

    def _intervals(self, t: int, z: int) -> list[tuple[int, int]] | None:
        """Per rank, the block counts with t_r <= t and every tail term <= z; None if the sums
        cannot meet L."""
        out = []
        tau, fixed = self.tau_ns, self.fixed_ns
        low = high = 0
        for r, (lo, hi) in enumerate(self._bounds()):
            t_hi = hi if tau == 0 else (t - fixed[r]) // tau
            if tau == 0 and t < fixed[r]:
                return None
            z_lo, z_hi = self._z_interval(r, z)
            a, b = max(lo, z_lo), min(hi, t_hi, z_hi)
            if a > b:
                return None
            low, high = low + a, high + b
            out.append((int(a), int(b)))
        if low > self.L or high < self.L:
            return None
        for ranks, coeffs, room in self.host_rows:  # a node's row caps its ranks' total
            most = self._row_most(out, ranks, coeffs, room)
            if most is None:
                return None
            high -= sum(out[r][1] for r in ranks) - most
        if high < self.L:
            return None
        return out

    @staticmethod
    def _row_most(intervals: list[tuple[int, int]], ranks: tuple[int, ...], coeffs: tuple[int, ...],
                  room: int) -> int | None:
        """The most blocks the ``ranks`` of one host row can hold within their intervals (None: not
        even their least). Every block counts one, so filling the ranks with the smallest
        coefficient first is optimal; every total between the least and this one is reachable."""
        budget = room - sum(a * intervals[r][0] for r, a in zip(ranks, coeffs))
        if budget < 0:
            return None
        total = sum(intervals[r][0] for r in ranks)
        for a, r in sorted(zip(coeffs, ranks)):
            lo, hi = intervals[r]
            extra = hi - lo if a == 0 else min(hi - lo, budget // a)
            total, budget = total + extra, budget - extra * a
        return total

    def _fill(self, intervals: list[tuple[int, int]]) -> list[int]:
        """Block counts within ``intervals`` summing to L (``_intervals`` said some exist): each rank
        at its least, then the rest dealt in rank order, within what each host row leaves a rank
        when its budget goes to the row's cheapest ranks first."""
        counts = [a for a, _ in intervals]
        room = [b - a for a, b in intervals]  # blocks a rank may still take
        left = self.L - sum(counts)
        for ranks, coeffs, row_room in self.host_rows:  # each row's budget to its cheapest ranks first
            budget = row_room - sum(a * counts[r] for r, a in zip(ranks, coeffs))
            for a, r in sorted(zip(coeffs, ranks)):
                if a > 0:
                    room[r] = min(room[r], budget // a)
                budget -= room[r] * a
        for r in self.ranks:
            take = min(left, room[r])
            counts[r] += take
            left -= take
        return counts

    def parametric(self) -> SplitSolution | None:
        """The exact optimum by parametric search on the two maxima; None when the program is too
        large for it (more than MAX_PARAMETRIC_VALUES candidate values).

        The objective is wT T + wZ Z with T = max_r t_r(N_r) and Z = max(0, max_r z_r(N_r)). For
        fixed caps T and Z every rank's feasible block counts form an interval, and a split exists
        iff the interval bounds sum around L. At the optimum T equals some t_r(n) and Z some
        z_r(n) (or 0), so: for each candidate T in increasing order, the least feasible Z is found
        by bisection over the candidate Z values (feasibility grows with Z); the walk stops once
        wT T + wZ Z_min, with Z_min the least Z of any T, reaches the best value found."""
        bounds = self._bounds()
        if any(lo > hi for lo, hi in bounds):
            return SplitSolution(chunk_blocks=None, status="INFEASIBLE", objective_s=math.inf, bound_s=math.inf,
                                 method="parametric")
        size = sum(hi - lo + 1 for lo, hi in bounds)
        if 2 * size > MAX_PARAMETRIC_VALUES:
            return None
        t_values = sorted({self.tau_ns * n + self.fixed_ns[r] for r, (lo, hi) in enumerate(bounds)
                           for n in range(lo, hi + 1)})
        z_values = sorted({0} | {max(0, max(c + k * n for c, k in self.tail_rows[r]))
                                 for r, (lo, hi) in enumerate(bounds) for n in range(lo, hi + 1)})

        def least_z(t: int) -> int | None:
            if self._intervals(t, z_values[-1]) is None:
                return None
            a, b = 0, len(z_values) - 1  # the answer is in z_values[a..b]
            while a < b:
                mid = (a + b) // 2
                if self._intervals(t, z_values[mid]) is None:
                    a = mid + 1
                else:
                    b = mid
            return z_values[a]

        z_floor = least_z(t_values[-1])
        if z_floor is None:
            return SplitSolution(chunk_blocks=None, status="INFEASIBLE", objective_s=math.inf, bound_s=math.inf,
                                 method="parametric")
        wt, wz = self.t_weight, self.z_weight
        best: tuple[int, int, int] | None = None  # value, T, Z
        for t in (t_values if wt > 0 else t_values[-1:]):
            if best is not None and wt * t + wz * z_floor >= best[0]:
                break
            z = least_z(t)
            if z is not None and (best is None or wt * t + wz * z < best[0]):
                best = (wt * t + wz * z, t, z)
        assert best is not None  # t_values[-1] is feasible (z_floor exists)
        intervals = self._intervals(best[1], best[2])
        assert intervals is not None
        counts = self._fill(intervals)
        value = self._objective(counts)
        value_s = (value + self.constant_ns) / (self.ns * self.cfg.virtual_stages)
        return SplitSolution(chunk_blocks=deal_chunks(counts, self.cfg.virtual_stages), status="OPTIMAL",
                             objective_s=value_s, bound_s=value_s, method="parametric")

    # -- CP-SAT ----------------------------------------------------------------------------------
    def _build_model(self) -> None:
        from ortools.sat.python import cp_model  # imported only when a program is too large to enumerate

        self.model = cp_model.CpModel()
        v = self.cfg.virtual_stages
        self.N = [self.model.NewIntVar(v, self.L, f"N_{r}") for r in self.ranks]
        self.T = self.model.NewIntVar(0, math.ceil(self.everything_s * self.ns) + 1, "T")
        self.Z = self.model.NewIntVar(0, math.ceil(self.tail_s * self.ns) + 1, "Z")
        self._add_block_count_constraints()
        self._add_slowest_stage_constraints()
        self._add_tail_constraints()
        self._add_memory_constraints()
        self._add_host_constraints()
        self.model.Minimize(self.t_weight * self.T + self.z_weight * self.Z)

    def _add_block_count_constraints(self) -> None:
        self.model.Add(sum(self.N) == self.L)

    def _add_slowest_stage_constraints(self) -> None:
        for r in self.ranks:
            self.model.Add(self.T >= self.tau_ns * self.N[r] + self.fixed_ns[r])

    def _add_tail_constraints(self) -> None:
        for r in self.ranks:
            for const, coeff in self.tail_rows[r]:
                self.model.Add(self.Z >= const + coeff * self.N[r])

    def _add_memory_constraints(self) -> None:
        """The memory family (module docstring), solved for the integer N_r once
        (``rank_block_capacity``), so the ILP and the search's pre-check read one rule."""
        for r, cap in enumerate(self.caps):
            self.model.Add(self.N[r] <= cap)

    def _add_host_constraints(self) -> None:
        """sum_{r on node} a_r N_r <= room per node group (host offload; one-rank groups are in ``caps``)."""
        for ranks, coeffs, room in self.host_rows:
            self.model.Add(sum(a * self.N[r] for r, a in zip(ranks, coeffs)) <= room)

    def solve(self, time_limit_s: float = 10.0, method: str = "auto") -> SplitSolution:
        """``method``: "auto" (the order of the module docstring), "enumeration", "parametric" or
        "cp-sat"."""
        if method not in ("auto", "enumeration", "parametric", "cp-sat"):
            raise ValueError(f"unknown split method {method!r}")
        if method == "enumeration" or (method == "auto" and self.count_splits() <= MAX_ENUMERATED_SPLITS):
            return self.enumerate()
        if method == "parametric":
            return self.parametric()
        from autopar.search import cp_sat_process

        return cp_sat_process.solve(self, time_limit_s)

    def solve_cp_sat(self, time_limit_s: float) -> SplitSolution:
        """The program solved by CP-SAT, in this process (``solve`` may hand it to the forked
        solver of ``cp_sat_process``, which calls this there)."""
        self._build_model()
        solver, name, found = run_cp_sat(self.model, time_limit_s, SOLVER_PARAMETERS)
        if not found:
            return SplitSolution(chunk_blocks=None, status=name, objective_s=math.inf, bound_s=math.inf)
        blocks = deal_chunks([int(solver.Value(x)) for x in self.N], self.cfg.virtual_stages)
        return SplitSolution(
            chunk_blocks=blocks, status=name,
            objective_s=(solver.ObjectiveValue() + self.constant_ns) / (self.ns * self.cfg.virtual_stages),
            bound_s=(solver.BestObjectiveBound() + self.constant_ns) / (self.ns * self.cfg.virtual_stages),
        )


def solve_split(terms: StageTerms, num_blocks: int, time_limit_s: float = 10.0,
                method: str = "auto", host: HostFamily | None = None) -> SplitSolution:
    """Optimal contiguous split of ``num_blocks`` blocks over the pipeline chunks of ``terms``
    (within the nodes' host memory too, given ``host``: ``cost.host.host_family``).

    ``method``: "auto" (enumeration, else CP-SAT: the module docstring),
    "enumeration", "parametric" or "cp-sat"."""
    return SplitILP(terms, num_blocks, host).solve(time_limit_s, method)


def rank_block_capacity(terms: StageTerms, schedule: tuple[str, int] | None = None) -> list[int]:
    """The most blocks each pipeline rank can hold within memory (the memory family alone);
    ``schedule``: (name, v) of another schedule of the same branch (the family reads the schedule
    only through each rank's in-flight micro-batches), else the terms' own.

    A split exists iff every rank can hold its v chunks of one block and the capacities add up to
    L; the search checks this before building an ILP."""
    t, cfg = terms, terms.config
    name, v = schedule or (cfg.schedule, cfg.virtual_stages)
    if (name, v) != (cfg.schedule, cfg.virtual_stages):  # what the schedule holds beyond its blocks
        t = evolve(t, config=evolve(cfg, schedule=name, virtual_stages=v))
    tables = [inflight_table(name, cfg.pp, r, cfg.num_microbatches, v) for r in range(cfg.pp)]
    last = chunk_rank(cfg.pp * v - 1, cfg.pp)
    first_backward = None
    if t.loss_free_grads > 0 and v == 1:  # GPipe: its forwards peak before any gradient exists (evaluate)
        share = t.loss_free_grads
        first_backward = (share * t.block_grads_bytes, share * t.state_split["grads"],
                          [t.rank_other_bytes(r, last, loss=False) + t.reserve_bytes for r in range(cfg.pp)])
    return block_capacities(t, pp=cfg.pp, virtual_stages=v, tables=tables,
                            loss_inflight=loss_inflight_microbatches(name, cfg.pp, cfg.num_microbatches),
                            sigma=t.state_bytes_per_param,
                            block_act_bytes=t.block.act_bytes,
                            other_bytes=[t.rank_other_bytes(r, chunk_rank(cfg.pp * v - 1, cfg.pp)) + t.reserve_bytes
                                         for r in range(cfg.pp)],
                            tied_params=t.tied_params, capacity_bytes=t.capacity_bytes,
                            window=t.window, first_backward=first_backward)


def block_capacities(t: StageTerms, *, pp: int, virtual_stages: int, tables: Sequence[InflightTable],
                     loss_inflight: float, sigma: float, block_act_bytes: float, other_bytes: Sequence[float],
                     tied_params: float, capacity_bytes: float,
                     window: tuple[int, float, float] = (0, 0.0, 0.0),
                     first_backward: tuple[float, float, Sequence[float]] | None = None,
                     edges: Sequence[tuple[float, float, float]] | None = None,
                     block_extra_bytes: float | None = None) -> list[int]:
    """The memory family solved for each rank's block count: the most blocks N whose model states
    (sigma pi N, moved by the gather window: ``window`` as ``StageTerms.window``, (K, bytes each
    block of the K largest chunks holds, bytes every block does not)) and activations fit beside
    the rank's fixed memory, the activations as the
    schedule holds them chunk by chunk (``tables[r]``: cost.memory.inflight_table; N dealt over
    the v chunks as ``deal_chunks`` deals it, the embedding in rank 0's first chunk), with ``t``'s
    block, embedding and head parameters and the embedding's and head's activations; the rest given
    (``rank_block_capacity`` passes ``t``'s own, search.fit_bound lower bounds of them). The same
    sums as ``cost.step.evaluate`` (``cost.memory.most_blocks``, one byte spare for float rounding).

    ``first_backward`` (one chunk, where the step's first backward follows every forward: GPipe,
    StageTerms.loss_free_grads): (gradient bytes absent per block, the same per parameter of the
    embedding and head, each rank's other bytes outside its loss). The peak is then the larger of
    two moments, each linear in N, and the cap the smaller of their caps: every forward done, no
    gradient made (A), and the first micro-batch's backward ending (B): every gradient beside the later
    micro-batches' activations, the first block's and embedding's of the first but their gradients,
    or, the block's backward done, its gradients but not its activations (the larger of the two).

    ``edges``: each rank's chunk edges per micro-batch (StageTerms.chunk_edges: the embedding's
    activations, a pipeline's handed-on outputs less its received inputs), ``t``'s own by default;
    ``block_extra_bytes``: what each block holds beside its states per parameter (FSDP2's padding,
    StageTerms.block_padding_bytes), ``t``'s own by default."""
    last_rank = chunk_rank(pp * virtual_stages - 1, pp)
    caps = []
    for r in range(pp):
        fixed_p = (t.pre.params if r == 0 else 0.0) + (t.post.params + tied_params if r == last_rank else 0.0)
        fixed = sigma * fixed_p + other_bytes[r]
        if r == last_rank:
            fixed += loss_inflight * t.post.act_bytes
        room = math.floor(capacity_bytes - fixed)
        pre = t.pre.act_bytes if r == 0 else 0.0
        edge = edges[r] if edges is not None else t.chunk_edges(r)
        per_block = sigma * t.block.params - window[2] + (t.block_padding_bytes if block_extra_bytes is None
                                                           else block_extra_bytes)
        if virtual_stages == 1:  # one chunk, one state: I_r micro-batches of every block (integer sums)
            inflight = tables[r].total
            one_chunk = sum(edge)  # the chunk is the rank's first and last
            if first_backward is not None:
                absent_block, absent_param, other_rest = first_backward
                moment_a = _linear_cap(capacity_bytes - fixed + absent_param * fixed_p - inflight * one_chunk,
                                       per_block - absent_block + inflight * block_act_bytes)
                later = inflight - 1  # micro-batches whose activations remain after the first's backward
                # the first micro-batch's first block's backward (its own and the embedding's gradients
                # not yet made) or the embedding's (that block's activations released): the larger
                fixed_c = (sigma * fixed_p - absent_param * (t.pre.params if r == 0 else 0.0) + other_rest[r]
                           + (later * t.post.act_bytes if r == last_rank else 0.0) + pre)
                fixed_b = fixed_c + max(0.0, block_act_bytes - absent_block)
                moment_b = _linear_cap(capacity_bytes - fixed_b - later * one_chunk,
                                       per_block + later * block_act_bytes)
                caps.append(min(moment_a, moment_b))
                continue
            per_block_int = math.ceil(per_block + inflight * block_act_bytes)
            room_int = math.floor(room - inflight * one_chunk)
            caps.append(room_int // per_block_int if per_block_int > 0 else (10**9 if room_int >= 0 else -1))
            continue
        caps.append(most_blocks(tables[r], per_block_bytes=per_block,
                                act_per_block_bytes=block_act_bytes, first_chunk_bytes=pre, room_bytes=room,
                                top_chunks=window[0], top_chunk_bytes=window[1], edges=edge,
                                moments=t.state_extras(r) if t.config.pp == pp else None))
    return caps


def _linear_cap(room_bytes: float, per_block_bytes: float) -> int:
    """The most N with N x ``per_block_bytes`` <= ``room_bytes`` in integer sums (bytes per block
    rounded up, the room down, as ``block_capacities``'s one-chunk family); -1 where none fit."""
    room, per = math.floor(room_bytes), math.ceil(per_block_bytes)
    return room // per if per > 0 else (10**9 if room >= 0 else -1)


def deal_chunks(rank_blocks: list[int], virtual_stages: int) -> tuple[int, ...]:
    """Chunk sizes in chunk order (chunk c on rank c mod pp) from per-rank block counts: each rank's
    blocks dealt over its chunks as evenly as possible, the larger chunks last (cost.memory.dealt_sizes)."""
    pp = len(rank_blocks)
    sizes = [0] * (pp * virtual_stages)
    for r, n in enumerate(rank_blocks):
        for k, size in enumerate(dealt_sizes(n, virtual_stages)):
            sizes[r + k * pp] = size
    return tuple(sizes)


def valid_split(chunk_blocks: list[int] | tuple[int, ...], pp: int) -> bool:
    """The rule ``deal_chunks`` follows: every chunk has a block, a rank's chunks differ by at most one."""
    for r in range(pp):
        sizes = chunk_blocks[r::pp]
        if sizes and max(sizes) - min(sizes) > 1:
            return False
    return all(n >= 1 for n in chunk_blocks)
