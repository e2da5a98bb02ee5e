r"""The split program with a per-rank recompute mix (per-stage recompute; docs/design.md §6): blocks per rank and mode.

The terms of a "mixed" config (``cost.stage.build_terms``) price one block under each recompute
mode m in {none, selective, full}: tau_m (forward+backward time of one micro-batch), beta_m (its
backward part), alpha_m (activation bytes per in-flight micro-batch) and w_m (the working set held
while a block of mode m re-runs). Parameters do not depend on the mode (pi, sigma as in
``search.ilp``). With the rest as in ``search.ilp`` (f_r, g_r, p_r, a_r, I_r, M, v):

    variables   n_{r,m} in {0..L}  (blocks of rank r under mode m),  N_r = sum_m n_{r,m} in {v..L},
                u_{r,m} in {0, 1}  (rank r uses mode m),  W_r >= 0,  T >= 0,  Z >= 0

    minimise    (M v - 1) T + sum_r t_r + v Z        (v times the step time; sum_r t_r is no
                                                      longer a constant: recompute costs time)

    where       t_r = sum_m tau_m  n_{r,m} + f_r
                b_r = sum_m beta_m n_{r,m} + g_r
                P_r = pi N_r + p_r

    subject to  sum_r N_r = L                                                  (blocks)
                T >= t_r                                          for all r    (slowest stage)
                Z >= floor + (c sync + gather + opt) P_r                 for all r    (tail)
                Z >= ((1 + c) sync + gather + opt) P_r - b_r      for all r    (unhidden sync)
                (without overlap of the sync: Z >= (sync + gather + opt) P_r alone, as in search.ilp)
                n_{r,m} <= L u_{r,m},                             for all r, m
                W_r >= w_m u_{r,m} - sum_{m' after m} a_{m'} n_{r,m'}    for all r, m (working set)
                sigma P_r + A_{r,s} + W_r + other <= capacity     for all r, s  (memory)
                host rows over the N_r, as in ``search.ilp``              (host memory, offload)

with A_{r,s} = sum_k s_k (a_r [k = 0] + sum_m alpha_m x_{r,k,m}) for each state s of the schedule
(s_k micro-batches in flight on local chunk k: cost.memory.inflight_states), x_{r,k,m} the blocks
of mode m in chunk k: N_r dealt over the chunks with the larger ones last (q_r = N_r div v each,
one more in the last N_r mod v), the full blocks first, then the selective, then the none
(``Plan.block_recompute``) -- linear through sum_{k' <= k} x_{r,k',full} = min(n_{r,full}, S_{r,k})
and the same for full + selective, S_{r,k} the blocks of chunks 0..k. One state, whose only count
is I_r, for 1F1B and GPipe.
where a_{m'} is one micro-batch's saved bytes of a block of mode m' and "after" is the order of a
rank's blocks (full, selective, none: ``cost.stage.RECOMPUTE_ORDER``): while a block of mode m
re-runs, its micro-batch has released what its later blocks saved (``StageTerms.mix_working_bytes``).
That is exactly ``cost.step.evaluate`` with ``recompute_blocks`` (the tests check it against a
walk of every split and every mix). Integer scaling as in ``search.ilp``: time in TIME_UNITS of one
micro-batch of the whole model without recompute, bytes as bytes (coefficients rounded up, capacity
down). Modes outside ``modes`` (the ones the model's executor cannot run, or selective where it
saves nothing) are fixed to 0.

Three exact solvers of the one program, tried in this order by ``solve``:

- ``enumerate`` -- for each rank and block count N the mixes that fit memory, reduced to the
  (t_r, z_r) Pareto front (the objective grows with every t_r and z_r, so a mix no better in both
  than another of the same N is never needed), then every split walked over those fronts, from the
  lowest objective found so far, dropping a prefix whose running maxima already reach it. Used when
  the fronts give at most MAX_ENUMERATED_MIXES combinations: milliseconds, and it cannot stall.
- ``parametric`` -- the same fronts; for fixed caps T and Z the least sum_r t_r is a min-plus
  knapsack over the ranks (pp x L x L steps), and the optimum is found by walking Z and T upwards
  over the fronts' values with bounds that stop both walks (the method's docstring). Polynomial:
  well under a second for GPT-3 175B on 8 pipeline ranks, where CP-SAT (either worker count) was
  measured stopping at its time limit without a proof on a third of the configurations.
- CP-SAT (OR-Tools) with one worker, when the fronts are too large to build (more than
  MAX_MIX_EVALUATIONS_PARAMETRIC mixes); OPTIMAL only when proven, else FEASIBLE at its time limit.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from autopar.cost.host import HostFamily
from autopar.cost.memory import RECOMPUTE_ORDER, dealt_sizes, most_blocks, top_blocks
from autopar.cost.terms import StageTerms
from autopar.plan import RECOMPUTE_MODES
from autopar.search.ilp import SplitILP, deal_chunks, run_cp_sat

SOLVER_PARAMETERS: dict[str, object] = {"num_workers": 1}
MAX_ENUMERATED_MIXES = 20_000  # split x front combinations walked by ``enumerate`` (beyond: the parametric search, faster there)
MAX_MIX_EVALUATIONS = 50_000  # (rank, mix) pairs priced to build the fronts
MAX_MIX_EVALUATIONS_PARAMETRIC = 400_000  # the same for ``parametric``, which needs the fronts too


@dataclass(frozen=True, kw_only=True)
class MixSolution:
    """The mixed split program's answer: chunk sizes and, per rank, (none, selective, full) counts."""

    chunk_blocks: tuple[int, ...] | None  # None: no split and mix fits memory
    recompute_blocks: tuple[tuple[int, int, int], ...] | None
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN
    objective_s: float
    bound_s: float
    method: str  # "enumeration", "parametric" or "cp-sat"


class MixedSplitILP:
    """The program of the module docstring; coefficients once, then ``enumerate`` or CP-SAT."""

    def __init__(self, terms: StageTerms, num_blocks: int, modes: tuple[str, ...] = RECOMPUTE_MODES,
                 host: HostFamily | None = None) -> None:
        """``host``: the nodes' host-memory rows (``cost.host.host_family``; offload only), over the
        ranks' block counts N_r as in ``search.ilp``: a one-rank row caps N_r, a row over several
        ranks is checked by ``enumerate`` and CP-SAT (``parametric`` then declines)."""
        if terms.recompute_parts is None:
            raise ValueError("MixedSplitILP needs the terms of a 'mixed' recompute config")
        self.terms, self.L, self.cfg = terms, num_blocks, terms.config
        self.host = host
        self.host_caps = host.rank_caps(self.cfg.pp, self.cfg.virtual_stages) if host is not None else None
        self.host_rows = host.shared_rows if host is not None else ()
        self.modes = tuple(m for m in RECOMPUTE_MODES if m in modes)
        self.base = SplitILP(terms, num_blocks)  # the single-mode coefficients: fixed terms, scaling, tail
        ns, t = self.base.ns, terms
        self.ranks = range(self.cfg.pp)
        parts = {m: t.recompute_parts[m] for m in self.modes}
        self.tau = {m: round(p.time_s * ns) for m, p in parts.items()}
        self.beta = {m: round(p.bwd_s * ns) for m, p in parts.items()}
        self.fixed_ns = self.base.fixed_ns
        self.fixed_bwd_ns = [round(self.base._fixed_bwd_s(r) * ns) for r in self.ranks]
        self.tail = [self._tail_rows(r) for r in self.ranks]  # per rank: (c1, k1, c2, k2): see _z
        # per rank and mode: what using the mode adds to the rank's other memory (its working set,
        # unless the loss's phase holds more: StageTerms.rank_other_bytes, exact since monotone)
        self.work = [{m: max(0, math.ceil(t.mode_working_bytes(r, self.base.last_rank, m))) for m in self.modes}
                     for r in self.ranks]
        # one micro-batch's saved bytes of a block of each mode, released before earlier modes re-run
        self.alpha1 = {m: math.floor(p.act_bytes) for m, p in parts.items()}
        self.later = {m: tuple(x for x in RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(m) + 1:] if x in self.modes)
                      for m in self.modes}
        # the activations as the schedule holds them, chunk by chunk (cost.memory.inflight_states),
        # as cost.step.evaluate prices them: ``used`` (the fronts, the capacities) and CP-SAT's rows
        # (``_chunk_modes``)
        # the interleaved schedule's gather window (StageTerms.window): the blocks of the K largest
        # chunks hold ``top`` bytes more, every block ``off`` less
        self.top_chunks, self.top_bytes, off = t.window
        self.state_per_block = t.state_bytes_per_param * t.block.params - off + t.block_padding_bytes
        self.act = {m: p.act_bytes for m, p in parts.items()}
        self.tables = [t.inflight_table(r) for r in self.ranks]
        # the moments each rank's memory is checked at and what each holds beyond its activations
        # (ZeRO-3 interleaved: StageTerms.state_extras; else the schedule's states, nothing beyond)
        moments = [t.state_extras(r) for r in self.ranks]
        self.moments = moments
        self.states = [table.states if mo is None else mo[0] for table, mo in zip(self.tables, moments)]
        self.extras = [(0.0,) * len(table.states) if mo is None else mo[1] for table, mo in zip(self.tables, moments)]
        self.room = [self._room(r) for r in self.ranks]
        m, v = self.cfg.num_microbatches, self.cfg.virtual_stages
        self.t_weight, self.z_weight, self.v = m * v - 1, v, v
        self._fronts: list | None = None
        self._options_by_z: tuple | None = None  # (fronts, _OptionTable): the parametric search's lookups

    # -- coefficients ------------------------------------------------------------------------
    def _tail_rows(self, r: int) -> tuple[int, int, int, int]:
        """Z >= c1 + k1 N_r and Z >= c2 + k2 N_r - (sum_m beta_m n_{r,m} + g_r) [overlap], or
        Z >= c2 + k2 N_r [no overlap: the b_r term is dropped]."""
        t, ns = self.terms, self.base.ns
        sync_ns = t.grad_sync_s_per_param * ns
        per_param_ns = t.after_sync_s_per_param * ns
        if t.grad_sync_overlaps:
            per_param_ns += t.overlap_cost_fraction * sync_ns
        fixed_p = self.base._fixed_params(r)
        c1 = round(t.grad_sync_floor_s * ns + per_param_ns * fixed_p)
        k1 = round(per_param_ns * t.block.params)
        c2 = round((sync_ns + per_param_ns) * fixed_p)
        k2 = round((sync_ns + per_param_ns) * t.block.params)
        if not t.grad_sync_overlaps:  # one family: the whole sync after backward, no floor of its own
            c1, k1 = c2, k2
        return c1, k1, c2, k2

    def _room(self, r: int) -> int:
        """Capacity less everything that does not depend on the counts (rounded down); the
        embedding's activations are ``used``'s (they weigh with the first chunk's count)."""
        t, base = self.terms, self.base
        fixed = (t.state_bytes_per_param * base._fixed_params(r) + t.reserve_bytes
                 + t.rank_other_bytes(r, base.last_rank))
        if r == base.last_rank:
            fixed += t.loss_inflight() * t.post.act_bytes
        return math.floor(t.capacity_bytes - fixed)

    def used(self, r: int, n: int, mixes):  # noqa: ANN001, ANN201 -- (count, k) int64 arrays in and out
        """Rank ``r``'s memory that depends on its mix (``mixes``: rows of counts over ``modes``,
        each summing to ``n``): the blocks' model states and the activations at the schedule's
        peak, the rank's blocks taking full, then selective, then none in execution order over its
        chunks as dealt (``Plan.block_recompute``), the embedding in rank 0's first chunk; rounded
        up. Not the working set (``work``)."""
        import numpy as np

        v = self.cfg.virtual_stages
        chunk_of = np.repeat(np.arange(v), dealt_sizes(n, v))  # each block position's local chunk
        col = {m: mixes[:, i] for i, m in enumerate(self.modes)}
        zero = np.zeros(len(mixes), dtype=np.int64)
        b1 = col.get("full", zero)
        b2 = b1 + col.get("selective", zero)
        a_full, a_sel, a_none = (self.act.get(m, 0.0) for m in RECOMPUTE_ORDER)
        edges = np.asarray(self.terms.chunk_edge_bytes(r))  # the embedding's, a pipeline's (StageTerms.chunk_edges)
        states = np.asarray(self.states[r], dtype=np.float64)  # (states, v)
        # prefix[s, k]: micro-batches in flight, in state s, summed over the first k block positions
        prefix = np.zeros((len(states), n + 1))
        np.cumsum(states[:, chunk_of], axis=1, out=prefix[:, 1:])
        act = (a_full * prefix[:, b1] + a_sel * (prefix[:, b2] - prefix[:, b1])
               + a_none * (prefix[:, n:n + 1] - prefix[:, b2]) + (states @ edges)[:, None]
               + np.asarray(self.extras[r])[:, None])
        states = self.state_per_block * n + self.top_bytes * top_blocks(dealt_sizes(n, v), self.top_chunks)
        return np.ceil(states + act.max(axis=0)).astype(np.int64)

    def capacity(self, host: bool = True) -> list[int]:
        """The most blocks each rank can hold, every block under its most frugal allowed mode, and
        within its node's host memory (``host``, when the program has host rows): an upper bound
        on N_r (what the search checks before solving)."""
        caps = []
        for r in self.ranks:
            best = -1
            for m in self.modes:
                # a mix can fit more blocks than its modes alone (its later blocks shrink the working
                # set, mix_working_bytes), so only a single-mode program may subtract the working set
                room = self.room[r] - (self.work[r][m] if len(self.modes) == 1 else 0)
                cap = most_blocks(self.tables[r], per_block_bytes=self.state_per_block,
                                  act_per_block_bytes=self.act[m], room_bytes=room,
                                  first_chunk_bytes=self.terms.pre.act_bytes if r == 0 else 0.0,
                                  top_chunks=self.top_chunks, top_chunk_bytes=self.top_bytes,
                                  edges=self.terms.chunk_edges(r), moments=self.moments[r])
                best = max(best, cap)
            caps.append(best)
        if host and self.host_caps is not None:
            caps = [min(a, b) for a, b in zip(caps, self.host_caps)]
        return caps

    # -- enumeration ---------------------------------------------------------------------------
    def _num_mixes(self) -> int:
        v, k = self.cfg.virtual_stages, len(self.modes)
        top = self.L - (self.cfg.pp - 1) * v
        return sum(math.comb(n + k - 1, k - 1) for cap in self.capacity() for n in range(v, min(top, cap) + 1))

    def _mixes(self, n: int):  # noqa: ANN202 -- yields count tuples over self.modes summing to n
        k = len(self.modes)
        for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
            bounds = (0, *cuts, n)
            yield tuple(bounds[i + 1] - bounds[i] for i in range(k))

    def fronts(self) -> list[dict[int, list[tuple[int, int, dict[str, int]]]]]:
        """Per rank: block count -> the (t_r, z_r, mix) Pareto front of the mixes that fit, in
        increasing t (so decreasing z). Built once per program (the two walks share it)."""
        if self._fronts is not None:
            return self._fronts
        v, modes = self.cfg.virtual_stages, self.modes
        top = self.L - (self.cfg.pp - 1) * v
        caps = self.capacity()
        import numpy as np

        tau_a = np.array([self.tau[m] for m in modes], dtype=np.int64)
        beta_a = np.array([self.beta[m] for m in modes], dtype=np.int64)
        overlap = self.terms.grad_sync_overlaps
        # released[m] = sum over the modes after m of a_m' n_m': mixes @ release, a (modes x modes) matrix
        release = np.array([[self.alpha1[b] if b in self.later[a] else 0 for a in modes] for b in modes],
                           dtype=np.int64)
        out = []
        for r in self.ranks:
            work_a = np.array([self.work[r][m] for m in modes], dtype=np.int64)
            room, f, g = self.room[r], self.fixed_ns[r], self.fixed_bwd_ns[r]
            c1, k1, c2, k2 = self.tail[r]
            per_n: dict[int, list[tuple[int, int, dict[str, int]]]] = {}
            for n in range(v, min(top, caps[r]) + 1):
                base_z = max(0, c1 + k1 * n)
                mixes = _compositions(n, len(modes))  # (count, k), in _mixes' order
                working = np.maximum(work_a - mixes @ release, 0)
                used = self.used(r, n, mixes) + np.max(np.where(mixes > 0, working, 0), axis=1)
                ok = used <= room
                if not ok.any():
                    continue
                mixes = mixes[ok]
                t = mixes @ tau_a + f
                if overlap:
                    z = np.maximum(base_z, c2 + k2 * n - mixes @ beta_a - g)
                else:
                    z = np.full(len(mixes), base_z, dtype=np.int64)
                order = np.lexsort((z, t))  # by t, then z; stable: the first mix of equal (t, z) first
                t, z, mixes = t[order], z[order], mixes[order]
                # Pareto front in increasing t: a mix is kept only if its z is below every earlier one.
                prev = np.concatenate(([np.iinfo(np.int64).max], np.minimum.accumulate(z)[:-1]))
                keep = z < prev
                front = [(int(tt), int(zz), dict(zip(modes, map(int, c))))
                         for tt, zz, c in zip(t[keep], z[keep], mixes[keep])]
                if front:
                    per_n[n] = front
            out.append(per_n)
        self._fronts = out
        return out

    def enumerate(self, limit: int | None = MAX_ENUMERATED_MIXES) -> MixSolution | None:
        """Every split over the Pareto fronts, exactly; None when there are more than ``limit``
        combinations (the walk is then left to CP-SAT)."""
        if limit is not None and self._num_mixes() > MAX_MIX_EVALUATIONS:
            return None
        fronts = self.fronts()
        if limit is not None and _count(fronts, self.L, limit) > limit:
            return None
        v, k = self.cfg.virtual_stages, len(fronts)
        wt, wz = self.t_weight, self.z_weight
        best: list = [math.inf, None]
        chosen: list = [None] * len(fronts)
        counts = [0] * len(fronts)
        closes: list = [None] * len(fronts)  # a host row over several ranks, checked at its last rank
        for row in self.host_rows:
            closes[row[0][-1]] = row

        def walk(r: int, left: int, t_max: int, z_max: int, t_sum: int) -> None:
            if wt * t_max + wz * z_max + t_sum >= best[0]:
                return  # every term only grows down the walk
            if r == len(fronts):
                if left == 0:
                    best[0], best[1] = wt * t_max + wz * z_max + t_sum, list(chosen)
                return
            for n, front in fronts[r].items():
                if n > left - v * (k - r - 1):  # every later rank needs its v chunks
                    break
                counts[r] = n
                row = closes[r]
                if row is not None and not HostFamily.row_holds(row, counts):
                    continue
                for t, z, c in front:
                    chosen[r] = c
                    walk(r + 1, left - n, max(t_max, t), max(z_max, z), t_sum + t)

        walk(0, self.L, 0, 0, 0)
        if best[1] is None:
            return MixSolution(chunk_blocks=None, recompute_blocks=None, status="INFEASIBLE", objective_s=math.inf,
                               bound_s=math.inf, method="enumeration")
        value_s = best[0] / (self.base.ns * self.v)
        return self._solution(best[1], "OPTIMAL", value_s, value_s, "enumeration")

    def _solution(self, mixes: list[dict[str, int]], status: str, objective_s: float, bound_s: float,
                  method: str) -> MixSolution:
        counts = tuple(tuple(c.get(m, 0) for m in RECOMPUTE_MODES) for c in mixes)
        return MixSolution(chunk_blocks=deal_chunks([sum(c) for c in counts], self.cfg.virtual_stages),
                           recompute_blocks=counts, status=status, objective_s=objective_s, bound_s=bound_s,
                           method=method)

    # -- parametric search -----------------------------------------------------------------------
    def parametric(self) -> MixSolution | None:
        """The exact optimum by parametric search on the two maxima T and Z; None when the fronts
        are too large to build (more than MAX_MIX_EVALUATIONS_PARAMETRIC mixes).

        For fixed caps T and Z, rank r's best use of N blocks is the first mix of its front (t
        increasing, z decreasing) with z <= Z, if its t <= T; the least sum_r t_r with sum_r N_r
        = L is then a min-plus knapsack over the ranks (``_least_sum``), and wT T + wZ Z + that sum
        bounds the objective of every split within the caps, with equality at the optimum's own
        maxima. T is walked upwards over the t values of the fronts from the least feasible T,
        and for each T, Z upwards from the least feasible Z (bisection: feasibility grows with Z,
        and the least feasible Z only falls as T grows) until wZ Z plus the least sum at the
        largest Z reaches the best found; the T walk stops once wT T plus the least wZ Z + sum of
        any T does. T first because wT = M v - 1 outweighs wZ = v: the T walk ends a few values
        past the optimum, where walking Z first visited most of the Z values (GPT-3 175B on
        1,024 H100s: 561 knapsacks instead of 6,896 for one config)."""
        if self._num_mixes() > MAX_MIX_EVALUATIONS_PARAMETRIC or self.host_rows:
            return None  # host rows over several ranks couple the knapsack's ranks: left to CP-SAT
        fronts = self.fronts()
        if any(not per_n for per_n in fronts):
            return MixSolution(chunk_blocks=None, recompute_blocks=None, status="INFEASIBLE", objective_s=math.inf,
                               bound_s=math.inf, method="parametric")
        t_values = sorted({t for per_n in fronts for front in per_n.values() for t, _, _ in front})
        z_values = self._option_table(fronts).z_values  # every z cap the walk asks for is one of these
        wt, wz = self.t_weight, self.z_weight
        if self._least_sum(fronts, math.inf, z_values[-1]) is None:
            return MixSolution(chunk_blocks=None, recompute_blocks=None, status="INFEASIBLE", objective_s=math.inf,
                               bound_s=math.inf, method="parametric")

        def least_index(values: list[int], feasible) -> int:  # noqa: ANN001 -- feasible(value) -> bool
            """The first index of ``values`` where ``feasible`` holds (it holds at the last and
            stays true upwards)."""
            a, b = 0, len(values) - 1
            while a < b:
                mid = (a + b) // 2
                if feasible(values[mid]):
                    b = mid
                else:
                    a = mid + 1
            return a

        def best_z(t_cap: float, z_hi: int, cap: float) -> tuple[float, int, int] | None:
            """min over Z of wZ Z + least sum under caps (t_cap, Z), Z from the least feasible one
            (at or below index ``z_hi``, feasible) upwards; stops once wZ Z + the least sum at
            the largest Z reaches the best so far or ``cap``. (value, Z, index of the least
            feasible Z), or None when nothing beats ``cap``."""
            k = least_index(z_values[: z_hi + 1], lambda z: self._least_sum(fronts, t_cap, z) is not None)
            sum_floor = self._least_sum(fronts, t_cap, z_values[-1])
            best: tuple[float, int, int] | None = None
            for z in z_values[k:]:
                if wz * z + sum_floor >= min(cap, best[0] if best else math.inf):
                    break
                total = self._least_sum(fronts, t_cap, z)
                if total is not None and (best is None or wz * z + total < best[0]):
                    best = (wz * z + total, z, k)
            return best

        # The least feasible T (at the largest Z cap), and the least wZ Z + sum at any T.
        first = least_index(t_values, lambda t: self._least_sum(fronts, t, z_values[-1]) is not None)
        floor = best_z(math.inf, len(z_values) - 1, math.inf)
        assert floor is not None  # z_values[-1] is feasible at no T cap
        best: tuple[int, int, int] | None = None  # value, T, Z
        z_hi = len(z_values) - 1  # the least feasible Z only falls as T grows
        for t in t_values[first:]:
            if best is not None and wt * t + floor[0] >= best[0]:
                break  # every larger T costs at least wT T + the least wZ Z + sum of any T
            found = best_z(t, z_hi, math.inf if best is None else best[0] - wt * t)
            if found is None:
                continue
            z_hi = found[2]
            if best is None or wt * t + found[0] < best[0]:
                best = (wt * t + int(found[0]), t, found[1])
        assert best is not None  # z_values[-1] is feasible
        mixes = self._least_sum(fronts, best[1], best[2], split=True)
        value_s = best[0] / (self.base.ns * self.v)
        return self._solution(mixes, "OPTIMAL", value_s, value_s, "parametric")

    def _least_sum(self, fronts: list, t_cap: float, z_cap: float, split: bool = False):  # noqa: ANN202
        """min sum_r t_r over splits with every t_r <= t_cap and z_r <= z_cap (None: no split);
        with ``split``, the mixes of a split that attains it."""
        inf = math.inf
        if not split:
            return self._least_sum_value(fronts, t_cap, z_cap)
        table = [0] + [inf] * self.L  # least sum of t over the ranks so far, by blocks used
        choices = []
        for per_n in fronts:
            nxt = [inf] * (self.L + 1)
            pick: dict[int, tuple[int, dict[str, int]]] = {}
            options = _options(per_n, t_cap, z_cap)
            for used, have in enumerate(table):
                if have == inf:
                    continue
                for n, t, c in options:
                    if used + n <= self.L and have + t < nxt[used + n]:
                        nxt[used + n] = have + t
                        if split:
                            pick[used + n] = (used, c)
            table = nxt
            choices.append(pick)
        if table[self.L] == inf:
            return None
        if not split:
            return table[self.L]
        mixes, used = [], self.L
        for pick in reversed(choices):
            used, c = pick[used]
            mixes.append(c)
        return mixes[::-1]

    def _least_sum_value(self, fronts: list, t_cap: float, z_cap: float) -> int | None:
        """``_least_sum``'s value alone, the knapsack as numpy array minima (float64 holds these
        integer sums exactly: they are below 2**53). numpy comes with ortools, which depends on it.
        Each rank's options come from ``_option_table`` (one column per z cap) instead of a walk of
        its fronts per call: the parametric search asks for tens of thousands of (T, Z) caps."""
        import numpy as np

        L = self.L
        table = np.full(L + 2, np.inf)  # table[L + 1] stays inf: where a shift reaches below 0 blocks
        table[0] = 0.0
        lookup = self._option_table(fronts)
        zi = lookup.z_index[z_cap]  # the parametric walk's z caps are the fronts' z values
        for r in range(len(fronts)):
            ts = lookup.first_t[r][:, zi]
            keep = ts <= t_cap
            if not keep.any():
                return None
            ts, source = ts[keep], lookup.source[r][keep]
            # nxt[s] = min over the options (n, t) of table[s - n] + t: one (options x L + 1) array
            # of shifted tables, its minimum down the options.
            nxt = (table[source] + ts[:, None]).min(axis=0)
            table[: L + 1] = nxt
        return None if math.isinf(table[L]) else int(table[L])

    def _option_table(self, fronts: list) -> "_OptionTable":
        """Per rank, the t of its best mix per block count under every z cap among the fronts' z
        values (``_options`` for all caps at once: the first entry of a front, in decreasing z, with
        z <= the cap; inf where there is none). Built once per program."""
        if self._options_by_z is not None and self._options_by_z[0] is fronts:
            return self._options_by_z[1]
        import numpy as np

        z_values = sorted({z for per_n in fronts for front in per_n.values() for _, z, _ in front})
        z_arr = np.array(z_values, dtype=np.float64)
        ns, first_t = [], []
        for per_n in fronts:
            counts = [n for n in per_n if n <= self.L]
            rows = np.full((len(counts), len(z_values)), np.inf)
            for i, n in enumerate(counts):
                t_front = np.array([t for t, _, _ in per_n[n]], dtype=np.float64)
                neg_z = -np.array([z for _, z, _ in per_n[n]], dtype=np.float64)  # increasing
                j = np.searchsorted(neg_z, -z_arr, side="left")  # first entry with z <= the cap
                found = j < len(t_front)
                rows[i, found] = t_front[j[found]]
            ns.append(np.array(counts, dtype=np.int64))
            first_t.append(rows)
        # where each count's shift reads the table: s - n, or L + 1 (an inf cell) below 0 blocks
        shift = [np.arange(self.L + 1)[None, :] - n[:, None] for n in ns]
        source = [np.where(d >= 0, d, self.L + 1) for d in shift]
        table = _OptionTable(z_values=z_values, z_index={z: i for i, z in enumerate(z_values)}, first_t=first_t,
                             source=source)
        self._options_by_z = (fronts, table)
        return table

    # -- CP-SAT ----------------------------------------------------------------------------------
    def _build_model(self) -> None:
        from ortools.sat.python import cp_model  # imported only when a program is too large to enumerate

        self.model = cp_model.CpModel()
        L, v = self.L, self.cfg.virtual_stages
        self.n = [{m: self.model.NewIntVar(0, L, f"n_{r}_{m}") for m in self.modes} for r in self.ranks]
        self.N = [sum(row.values()) for row in self.n]
        slowest = max(self.tau.values())
        self.T = self.model.NewIntVar(0, slowest * L + max(self.fixed_ns) + 1, "T")
        z_top = max(max(c1 + k1 * L, c2 + k2 * L) for c1, k1, c2, k2 in self.tail) + 1
        self.Z = self.model.NewIntVar(0, max(0, z_top), "Z")
        self._add_block_count_constraints(v)
        self._add_slowest_stage_constraints()
        self._add_tail_constraints()
        self._add_memory_constraints()
        self._add_host_constraints()
        self.t_ranks = [sum(self.tau[m] * x for m, x in row.items()) + self.fixed_ns[r] for r, row in enumerate(self.n)]
        self.model.Minimize(self.t_weight * self.T + sum(self.t_ranks) + self.z_weight * self.Z)

    def _add_block_count_constraints(self, v: int) -> None:
        self.model.Add(sum(self.N) == self.L)
        for n_r in self.N:
            self.model.Add(n_r >= v)

    def _add_slowest_stage_constraints(self) -> None:
        for r, row in enumerate(self.n):
            self.model.Add(self.T >= sum(self.tau[m] * x for m, x in row.items()) + self.fixed_ns[r])

    def _add_tail_constraints(self) -> None:
        for r, row in enumerate(self.n):
            c1, k1, c2, k2 = self.tail[r]
            self.model.Add(self.Z >= c1 + k1 * self.N[r])
            if self.terms.grad_sync_overlaps:
                b_r = sum(self.beta[m] * x for m, x in row.items()) + self.fixed_bwd_ns[r]
                self.model.Add(self.Z >= c2 + k2 * self.N[r] - b_r)
            else:
                self.model.Add(self.Z >= c2 + k2 * self.N[r])

    def _add_memory_constraints(self) -> None:
        for r, row in enumerate(self.n):
            w_r = self.model.NewIntVar(0, max(self.work[r].values(), default=0), f"W_{r}")
            for m, x in row.items():
                if self.work[r][m] > 0:
                    u = self.model.NewBoolVar(f"u_{r}_{m}")
                    self.model.Add(x <= self.L * u)
                    released = sum(self.alpha1[b] * row[b] for b in self.later[m] if b in row)
                    self.model.Add(w_r >= self.work[r][m] * u - released)
            chunks, sizes = self._chunk_modes(r, row)
            edges = [math.ceil(e) for e in self.terms.chunk_edge_bytes(r)]  # the embedding's, a pipeline's
            per_block = math.ceil(self.state_per_block)
            act = {m: math.ceil(a) for m, a in self.act.items()}
            states = per_block * self.N[r]
            if self.top_chunks:  # the gather window: the dealt chunks' last (largest) K (rounded up, as per_block)
                states += math.ceil(self.top_bytes) * sum(sizes[-self.top_chunks:])
            for state, extra in zip(self.states[r], self.extras[r]):  # the peak states (cost.memory, held_states)
                self.model.Add(states + sum(n * e for n, e in zip(state, edges)) + math.ceil(extra) + w_r
                               + sum(n * act[m] * chunk[m] for n, chunk in zip(state, chunks) for m in chunk)
                               <= self.room[r])

    def _chunk_modes(self, r: int, row: dict) -> tuple[list[dict], list]:  # noqa: ANN201 -- linear exprs
        """Rank ``r``'s blocks of each mode in each local chunk (mode -> linear expression), and
        each chunk's size, as ``used`` places them: N_r dealt
        over the v chunks with the larger ones last (q = N_r // v in each, one more in the last
        N_r mod v), then full, selective and none in execution order -- the full blocks up to chunk
        k are min(n_full, S_k), with S_k the blocks of chunks 0..k, and full or selective ones
        min(n_full + n_sel, S_k)."""
        v, L, model = self.cfg.virtual_stages, self.L, self.model
        q = model.NewIntVar(0, L, f"q_{r}")
        e = model.NewIntVar(0, v - 1, f"e_{r}")
        model.AddDivisionEquality(q, self.N[r], v)
        model.AddModuloEquality(e, self.N[r], v)
        full = row.get("full", 0)
        full_sel = model.NewIntVar(0, L, f"fs_{r}")
        model.Add(full_sel == full + row.get("selective", 0))
        out, sizes, before, prev_f, prev_fs = [], [], 0, 0, 0
        for k in range(v):
            extra = model.NewBoolVar(f"x_{r}_{k}")
            model.Add(e >= v - k).OnlyEnforceIf(extra)
            model.Add(e <= v - k - 1).OnlyEnforceIf(extra.Not())
            size = q + extra
            upto = model.NewIntVar(0, L, f"S_{r}_{k}")
            model.Add(upto == before + size)
            f_k = model.NewIntVar(0, L, f"F_{r}_{k}")
            fs_k = model.NewIntVar(0, L, f"FS_{r}_{k}")
            model.AddMinEquality(f_k, [full, upto] if "full" in row else [0, upto])
            model.AddMinEquality(fs_k, [full_sel, upto])
            modes = {"full": f_k - prev_f, "selective": fs_k - f_k - (prev_fs - prev_f), "none": size - (fs_k - prev_fs)}
            out.append({m: x for m, x in modes.items() if m in self.act})
            sizes.append(size)
            before, prev_f, prev_fs = upto, f_k, fs_k
        return out, sizes

    def _add_host_constraints(self) -> None:
        """The nodes' host memory (host offload): N_r <= its one-rank cap, and each several-rank row."""
        if self.host_caps is not None:
            for n_r, cap in zip(self.N, self.host_caps):
                self.model.Add(n_r <= cap)
        for ranks, coeffs, room in self.host_rows:
            self.model.Add(sum(a * self.N[r] for r, a in zip(ranks, coeffs)) <= room)

    def solve(self, time_limit_s: float = 10.0, method: str = "auto") -> MixSolution:
        """``method``: "auto" (enumeration when small enough, else the parametric search, else
        CP-SAT), "enumeration", "parametric" or "cp-sat"."""
        if method not in ("auto", "enumeration", "parametric", "cp-sat"):
            raise ValueError(f"unknown mixed split method {method!r}")
        if method in ("auto", "enumeration"):
            sol = self.enumerate(None if method == "enumeration" else MAX_ENUMERATED_MIXES)
            if sol is not None:
                return sol
        if method in ("auto", "parametric"):
            sol = self.parametric()
            if sol is not None or method == "parametric":
                return sol
        from autopar.search import cp_sat_process

        return cp_sat_process.solve(self, time_limit_s)

    def solve_cp_sat(self, time_limit_s: float) -> MixSolution:
        """The program solved by CP-SAT, in this process (``solve`` may hand it to the forked
        solver of ``cp_sat_process``, which calls this there)."""
        self._build_model()
        solver, name, found = run_cp_sat(self.model, time_limit_s, SOLVER_PARAMETERS)
        if not found:
            return MixSolution(chunk_blocks=None, recompute_blocks=None, status=name, objective_s=math.inf,
                               bound_s=math.inf, method="cp-sat")
        mixes = [{m: int(solver.Value(x)) for m, x in row.items()} for row in self.n]
        scale = self.base.ns * self.v
        return self._solution(mixes, name, solver.ObjectiveValue() / scale, solver.BestObjectiveBound() / scale,
                              "cp-sat")


@dataclass(frozen=True, kw_only=True)
class _OptionTable:
    """``MixedSplitILP._option_table``: the z caps (value -> column) and, per rank, the t of each
    block count's best mix under each z cap, with where each count's shift reads the knapsack table."""

    z_values: list  # the fronts' z values, increasing
    z_index: dict
    first_t: list
    source: list  # per rank, (counts x L + 1) table indices of each count's shift


def _options(per_n: dict[int, list], t_cap: float, z_cap: float) -> list[tuple[int, int, dict[str, int]]]:
    """A rank's best mix per block count within the caps, as (n, t, mix): the first entry of its
    front within ``z_cap`` (fronts run in increasing t, decreasing z), kept if within ``t_cap``."""
    options = []
    for n, front in per_n.items():
        for t, z, c in front:
            if z <= z_cap:
                if t <= t_cap:
                    options.append((n, t, c))
                break
    return options


def _count(fronts: list[dict[int, list]], total: int, limit: int) -> int:
    """Split x front combinations summing to ``total`` (counting stops past ``limit``).

    ways[s]: the combinations of the ranks so far using s blocks, capped at limit + 1 (a capped
    term keeps every sum it enters capped, so "more than limit" stays exact); each rank convolves
    it with its front sizes per block count. int64 holds the uncapped products: at most
    (limit + 1) x (largest front) x (total + 1)."""
    import numpy as np

    ways = np.zeros(total + 1, dtype=np.int64)
    ways[0] = 1
    for per_n in fronts:
        sizes = np.zeros(total + 1, dtype=np.int64)
        for n, front in per_n.items():
            if n <= total:
                sizes[n] = len(front)
        ways = np.minimum(limit + 1, np.convolve(ways, sizes)[: total + 1])
    return int(ways[total])


def solve_mixed_split(terms: StageTerms, num_blocks: int, modes: tuple[str, ...] = RECOMPUTE_MODES,
                      time_limit_s: float = 10.0, method: str = "auto") -> MixSolution:
    """Optimal split and per-rank recompute counts of ``num_blocks`` blocks for a "mixed" config."""
    return MixedSplitILP(terms, num_blocks, modes).solve(time_limit_s, method)


def mixed_block_capacity(terms: StageTerms, modes: tuple[str, ...] = RECOMPUTE_MODES) -> list[int]:
    """``MixedSplitILP.capacity`` of ``terms``: each rank's most blocks under its most frugal mode."""
    return MixedSplitILP(terms, 1, modes).capacity()


@functools.lru_cache(maxsize=4096)
def _compositions(n: int, k: int):  # noqa: ANN202 -- a read-only (count, k) int64 numpy array
    """Every k-tuple of counts summing to n, in ``MixedSplitILP._mixes``' order (the cut points of
    ``itertools.combinations_with_replacement``), as one array; cached: every rank and program of a
    search asks for the same n."""
    import numpy as np

    if k == 1:
        arr = np.array([[n]], dtype=np.int64)
    elif k == 2:
        a = np.arange(n + 1, dtype=np.int64)
        arr = np.stack([a, n - a], axis=1)
    elif k == 3:
        a, b = np.triu_indices(n + 1)  # a <= b, row-major: the order of the cut pairs (a, b)
        arr = np.stack([a, b - a, n - b], axis=1).astype(np.int64)
    else:
        arr = np.array([(0, *cuts, n) for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1)],
                       dtype=np.int64)
        arr = np.diff(arr, axis=1)
    arr.setflags(write=False)
    return arr
