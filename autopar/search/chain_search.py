"""The search for a chain model (graph.chain: no repeated block): every legal configuration with one
chunk per pipeline rank, each priced by its exact per-unit terms (cost/chain.py) and, at pp > 1,
split by the optimal contiguous partition of the chain (search/partition.py).

Configurations are visited in increasing order of a lower bound on their step time, max(the
FLOPs at peak, M * (all units + stem + head) / pp: every rank runs all M micro-batches and the
ranks share the work), and a configuration whose bound reaches the k-th best plan found is not
solved; the partition program drops prefixes that reach it too. Both are true lower bounds of
``evaluate_chain``, so the top k returned are the top k of the space under the cost model, except
GPipe where 1F1B is legal (same time, more memory; never costed, as in search/search.py).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Callable

from autopar.cluster import Cluster
from autopar.cost.chain import (
    ChainTerms,
    StageLoad,
    build_chain_terms,
    cut_buffers_bytes,
    cut_edge_bytes,
    evaluate_chain,
    first_backward_bytes,
    stage_memory,
    stage_tail_s,
)
from autopar.graph.model_graph import ModelGraph
from autopar.plan import even_stage_ranges
from autopar.search.candidates import Candidate, SearchResult, TopK
from autopar.search.partition import optimal_partition
from autopar.search.space import SearchSpace, enumerate_configs


class StagePricer:
    """``(a, b, rank) -> (time, tail)`` of a stage, or None when it does not fit memory; O(1) per
    call from prefix sums and range maxima (the same sums and maxima ``cost.chain.stage_load``
    forms; the memory is ``cost.chain.stage_memory`` of that load)."""

    def __init__(self, terms: ChainTerms) -> None:
        self.terms, self.L = terms, terms.num_units
        acc: dict[str, list[float]] = {"time": [0.0], "bwd": [0.0], "params": [0.0], "act": [0.0], "experts": [0.0]}
        for u, ex in zip(terms.units, terms.expert_units or (False,) * self.L):
            for key, val in (("time", u.time_s), ("bwd", u.bwd_s), ("params", u.params), ("act", u.act_bytes),
                             ("experts", float(ex))):
                acc[key].append(acc[key][-1] + val)
        self.acc = acc
        self.transient = _RangeMax(terms.unit_transient_bytes)
        # cost.chain.stage_phase_bytes: max_u (phase_u + A_{u+1}) over the range, less A_end
        self.phase = _RangeMax(tuple(p + acc["act"][u + 1] for u, p in enumerate(terms.unit_phase_bytes)))

    def load(self, a: int, b: int, rank: int) -> StageLoad:
        """``cost.chain.stage_load(terms, a, b, rank)`` from the sums."""
        terms, t, acc = self.terms, self.terms.base, self.acc
        pp = terms.config.pp
        time_s = acc["time"][b] - acc["time"][a]
        bwd = acc["bwd"][b] - acc["bwd"][a]
        params = acc["params"][b] - acc["params"][a]
        act = acc["act"][b] - acc["act"][a]
        if a > 0:
            time_s += terms.cut_p2p_s[a]
        if b < self.L:
            time_s += terms.cut_p2p_s[b]
        if rank == 0:
            time_s, bwd, params, act = time_s + t.pre.time_s, bwd + t.pre.bwd_s, params + t.pre.params, act + t.pre.act_bytes
        if rank == pp - 1:
            time_s, bwd = time_s + t.post.time_s, bwd + t.post.bwd_s
            params, act = params + t.post.params + t.tied_params, act + t.post.act_bytes
        return StageLoad(time_s=time_s, bwd_s=bwd, params=params, act_bytes=act,
                         transient_bytes=self.transient(a, b), expert_units=round(acc["experts"][b] - acc["experts"][a]),
                         phase_bytes=self.phase(a, b) - acc["act"][b], buffer_bytes=cut_buffers_bytes(terms, a, b),
                         edge_bytes=cut_edge_bytes(terms, a, b),
                         first_backward_bytes=first_backward_bytes(terms, a, b, rank))

    def __call__(self, a: int, b: int, rank: int) -> tuple[float, float] | None:
        load = self.load(a, b, rank)
        if sum(stage_memory(self.terms, load, rank).values()) > self.terms.base.capacity_bytes:
            return None
        return load.time_s, stage_tail_s(self.terms, load)


class _RangeMax:
    """The largest of ``values[a:b]`` in O(1) (a sparse table)."""

    def __init__(self, values: tuple[float, ...]) -> None:
        self.table = [list(values)]
        k = 1
        while 2 * k <= len(values):
            prev = self.table[-1]
            self.table.append([max(prev[i], prev[i + k]) for i in range(len(prev) - k)])
            k *= 2

    def __call__(self, a: int, b: int) -> float:
        j = (b - a).bit_length() - 1
        row = self.table[j]
        return max(row[a], row[b - (1 << j)])


def search_chain(graph: ModelGraph, cluster: Cluster, space: SearchSpace, *, top_k: int = 5,
                 progress: Callable[[int, int, float], None] | None = None) -> SearchResult:
    """The top ``top_k`` plans of the chain model ``graph`` (module docstring)."""
    start = time.perf_counter()
    rejected: Counter = Counter()
    tokens = space.global_batch * space.seq_len
    model_flops = graph.model_flops_per_sample() * space.global_batch
    flop_lb = model_flops / (space.num_gpus * cluster.peak_flops)
    L = graph.num_blocks
    bounded: list[tuple[float, int, ChainTerms]] = []
    num_configs = 0
    for cfg in enumerate_configs(graph, space, rejected):
        num_configs += 1
        if cfg.virtual_stages > 1:
            rejected["interleaved: a chain model is planned with one chunk per pipeline rank"] += 1
            continue
        if cfg.pp > 1 and cfg.schedule == "gpipe" and "1f1b" in space.schedules and cfg.num_microbatches >= cfg.pp:
            rejected["dominated: gpipe (1f1b is as fast with less memory)"] += 1
            continue
        terms = build_chain_terms(graph, cluster, cfg)
        work = sum(u.time_s for u in terms.units) + terms.base.pre.time_s + terms.base.post.time_s
        bounded.append((max(flop_lb, cfg.num_microbatches * work / cfg.pp), len(bounded), terms))
    bounded.sort(key=lambda x: (x[0], x[1]))
    top = TopK(top_k)
    evaluated = solved = 0
    for k, (lb, _, terms) in enumerate(bounded):
        if progress and k % 200 == 0:
            progress(k, len(bounded), time.perf_counter() - start)
        threshold = top.threshold()
        if lb >= threshold:
            rejected["bound: cannot beat the best plans"] += 1
            continue
        cfg = terms.config
        if cfg.pp == 1:
            ranges, status, objective = ((0, L),), "DIRECT", None
        else:
            solved += 1
            pricer = StagePricer(terms)
            rest = [pricer.acc["time"][L] - pricer.acc["time"][b] + terms.base.post.time_s for b in range(L + 1)]
            part = optimal_partition(L, cfg.pp, cfg.num_microbatches, pricer, threshold, rest)
            if part is None:
                rejected["memory or bound: no partition fits and beats the best plans" if threshold < math.inf
                         else "memory: no partition of the chain fits"] += 1
                continue
            ranges, status, objective = part.ranges, part.status, part.objective_s
        est = evaluate_chain(terms, ranges, model_flops, tokens, cluster.peak_flops)
        evaluated += 1
        if not est.fits:
            rejected["memory: does not fit"] += 1
            continue
        obj = est.step_time_s if objective is None else objective
        top.offer(Candidate(config=cfg, chunk_blocks=tuple(b - a for a, b in ranges), estimate=est,
                            ilp_status=status, ilp_objective_s=obj, ilp_bound_s=obj))
    if progress:
        progress(len(bounded), len(bounded), time.perf_counter() - start)
    min_mem, min_cfg = math.inf, None
    if not top.items:
        for _, _, terms in bounded:
            even = tuple(even_stage_ranges(L, terms.config.pp))
            peak = evaluate_chain(terms, even, 0.0, 1.0, cluster.peak_flops).peak_memory_bytes
            if peak < min_mem:
                min_mem, min_cfg = peak, terms.config
    return SearchResult(
        top=tuple(top.items), num_configs=num_configs, num_evaluated=evaluated, num_ilp_solved=solved,
        rejected=dict(rejected), elapsed_s=time.perf_counter() - start, optimal=True,
        min_memory_bytes=min_mem, min_memory_config=min_cfg, capacity_bytes=cluster.usable_memory_bytes,
    )
