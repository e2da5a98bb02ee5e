"""The nodes' host memory inside the split program (issue 17): with offload, the split chosen is the
fastest one that fits the host too, equal to a brute force over every split, for the node layouts
with closed forms (a node inside one pipeline rank, a node holding several)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from autopar.cluster import load_cluster
from autopar.cost.host import evaluate_with_host, host_family, host_memory_by_rank
from autopar.cost.stage import Config, build_terms
from autopar.plan import Offload
from autopar.search.ilp import solve_split

NUM_BLOCKS = 16


def _config(dp: int, tp: int, pp: int, schedule: str = "1f1b") -> Config:
    return Config(dp=dp, tp=tp, pp=pp, cp=1, cp_kind="ring", sequence_parallel=tp > 1, zero=1, recompute="none",
                  schedule=schedule, virtual_stages=1, micro_batch=1, global_batch=8 * dp, seq_len=1024,
                  dtype_bytes=2, optimizer="adam", offload=Offload(optimizer=True, activations=True))


def _splits(pp: int):
    for cuts in itertools.combinations(range(1, NUM_BLOCKS), pp - 1):
        edges = (0, *cuts, NUM_BLOCKS)
        yield [b - a for a, b in zip(edges, edges[1:])]


_CASES: dict[tuple[int, int, int], tuple] = {}  # the brute force once per layout, not per method


def _host_bound_case(graph, cluster, dp: int, tp: int, pp: int):
    if (dp, tp, pp) not in _CASES:
        _CASES[(dp, tp, pp)] = _brute_force(graph, cluster, dp, tp, pp)
    return _CASES[(dp, tp, pp)]


def _brute_force(graph, cluster, dp: int, tp: int, pp: int):
    """Terms whose host capacity lies between the least any split needs and what the fastest split
    needs, so the host rows bind; and the brute-force best split that fits."""
    terms = build_terms(graph, cluster, _config(dp, tp, pp))
    rows = [(s, evaluate_with_host(terms, s, 1.0, 1.0, cluster)) for s in _splits(pp)]
    fastest = min(rows, key=lambda r: r[1].step_time_s)[1].host["host_memory_bytes"]
    least = min(e.host["host_memory_bytes"] for _, e in rows)
    assert least < fastest, "the case must make host memory bind"
    tight = dataclasses.replace(cluster, host_memory_bytes_per_node=(least + fastest) / 2)
    terms = build_terms(graph, tight, _config(dp, tp, pp))
    fitting = [(s, evaluate_with_host(terms, s, 1.0, 1.0, tight)) for s in _splits(pp)]
    best = min((e.step_time_s for _, e in fitting if e.fits), default=None)
    return terms, tight, best


# (dp, tp, pp) on 8-GPU nodes: a node inside one pipeline rank (dp tp = 8), a node holding two
# ranks (dp tp = 4) and one holding all eight (dp tp = 1)
@pytest.mark.parametrize("dp,tp,pp", [(1, 8, 4), (2, 2, 4), (1, 1, 8)])
@pytest.mark.parametrize("method", ["enumeration", "parametric", "cp-sat"])
def test_split_within_host_memory_equals_brute_force(small_gpt, a100, dp, tp, pp, method) -> None:
    terms, tight, best = _host_bound_case(small_gpt, a100, dp, tp, pp)
    assert best is not None
    host = host_family(terms, tight.gpus_per_node)
    assert host is not None and host.groups
    sol = solve_split(terms, NUM_BLOCKS, method=method, host=host)
    assert sol.status == "OPTIMAL" and sol.chunk_blocks is not None
    est = evaluate_with_host(terms, list(sol.chunk_blocks), 1.0, 1.0, tight)
    assert est.fits
    assert est.step_time_s == pytest.approx(best, rel=1e-5)
    # without the rows the program picks a faster split that overflows the host
    plain = solve_split(terms, NUM_BLOCKS, method=method)
    assert not evaluate_with_host(terms, list(plain.chunk_blocks), 1.0, 1.0, tight).fits


def test_a_node_inside_one_pipeline_rank_makes_host_memory_a_block_cap(small_gpt, a100) -> None:
    terms, tight, _ = _host_bound_case(small_gpt, a100, 1, 8, 4)
    host = host_family(terms, tight.gpus_per_node)
    assert all(len(ranks) == 1 for ranks, _, _ in host.groups)
    caps = host.rank_caps(4, 1)
    for r, cap in enumerate(caps):  # the cap is the most blocks whose node's host bytes fit
        for n, fits in ((cap, True), (cap + 1, False)):
            split = [n if q == r else 1 for q in range(4)]
            est = evaluate_with_host(terms, split, 1.0, 1.0, tight)
            node_bytes = 8 * host_memory_by_rank(terms, est)[r]
            assert (node_bytes <= tight.host_memory_bytes_per_node) is fits


def test_no_offload_gives_no_host_rows(small_gpt, a100) -> None:
    terms = build_terms(small_gpt, a100, dataclasses.replace(_config(1, 8, 4), offload=Offload()))
    assert host_family(terms, 8) is None


# -- the recompute-mix program (search.ilp_recompute) under the same rows -------------------------

def _mix_case():
    """A 6-block GPT whose GPUs hold a split only with some recompute, on dp 8 x pp 3 with the
    optimizer states on the host (a node inside each pipeline rank), its host memory between the
    least any fitting split and mix needs and what the fastest one needs."""
    from autopar.models.gpt import GPTConfig
    from autopar.reference import gpt_graph

    graph = gpt_graph(GPTConfig(num_layers=6, hidden_size=128, num_heads=4, seq_len=64, vocab_size=4096))
    # 11 MiB: the last rank also holds its loss's fp32 copies while the loss runs (graph/live.py); sized on
    # Megatron's schedules (no pipeline receive buffer per micro-batch)
    cluster = dataclasses.replace(load_cluster("a100-80g-megatron"), memory_margin_fraction=0.0, memory_bytes=11 * 2**20,
                                  framework_reserve_bytes=0.0, nccl_bytes_per_group=0.0)
    cfg = dataclasses.replace(_config(8, 1, 3), recompute="mixed", sequence_parallel=False, micro_batch=2,
                              global_batch=128, seq_len=64, offload=Offload(optimizer=True))
    terms = build_terms(graph, cluster, cfg)
    rows = [(e.step_time_s, e.host["host_memory_bytes"], split, mix)
            for split in _splits_of(6, 3) for mix in itertools.product(*(_mixes(n) for n in split))
            for e in [evaluate_with_host(terms, split, 1.0, 1.0, cluster, recompute_blocks=mix)]
            if e.peak_memory_bytes <= e.capacity_bytes]
    fastest, least = min(rows)[1], min(r[1] for r in rows)
    assert least < fastest, "the case must make host memory bind"
    tight = dataclasses.replace(cluster, host_memory_bytes_per_node=(least + fastest) / 2)
    return graph, tight, dataclasses.replace(terms, offload=dataclasses.replace(
        terms.offload, host_memory_bytes_per_node=tight.host_memory_bytes_per_node)), rows


def _splits_of(num_blocks: int, pp: int):
    for cuts in itertools.combinations(range(1, num_blocks), pp - 1):
        edges = (0, *cuts, num_blocks)
        yield [b - a for a, b in zip(edges, edges[1:])]


def _mixes(n: int):
    return [(n - full - sel, sel, full) for full in range(n + 1) for sel in range(n - full + 1)]


@pytest.mark.parametrize("method", ["enumeration", "parametric", "cp-sat"])
def test_recompute_mix_within_host_memory_equals_brute_force(method) -> None:
    from autopar.search.ilp_recompute import MixedSplitILP

    graph, tight, terms, rows = _mix_case()
    best = min(t for t, host, _, _ in rows if host <= tight.host_memory_bytes_per_node)
    sol = MixedSplitILP(terms, 6, host=host_family(terms, tight.gpus_per_node)).solve(method=method)
    assert sol.status == "OPTIMAL"
    est = evaluate_with_host(terms, list(sol.chunk_blocks), 1.0, 1.0, tight, recompute_blocks=sol.recompute_blocks)
    assert est.fits and est.step_time_s == pytest.approx(best, rel=1e-6)
    plain = MixedSplitILP(terms, 6).solve(method=method)  # without the rows: the faster mix overflows the host
    assert not evaluate_with_host(terms, list(plain.chunk_blocks), 1.0, 1.0, tight,
                                  recompute_blocks=plain.recompute_blocks).fits


@pytest.mark.parametrize("method", ["enumeration", "cp-sat", "auto"])
def test_a_host_row_over_several_ranks_binds_the_mix_program(method) -> None:
    """A node holding all three pipeline ranks: one row over their block counts (here a synthetic
    one, N_0 + 3 N_1 + N_2 <= 10, so N_1 <= 2); the parametric search declines such rows."""
    from autopar.cost.host import HostFamily
    from autopar.search.ilp_recompute import MixedSplitILP

    graph, tight, terms, _ = _mix_case()
    row = HostFamily(groups=(((0, 1, 2), (1, 3, 1), 10),))
    roomy = dataclasses.replace(tight, host_memory_bytes_per_node=1e18)
    free = dataclasses.replace(terms, offload=dataclasses.replace(terms.offload, host_memory_bytes_per_node=1e18))
    best = min(e.step_time_s for split in _splits_of(6, 3) if split[0] + 3 * split[1] + split[2] <= 10
               for mix in itertools.product(*(_mixes(n) for n in split))
               for e in [evaluate_with_host(free, split, 1.0, 1.0, roomy, recompute_blocks=mix)] if e.fits)
    unbound = [sum(c) for c in MixedSplitILP(free, 6).solve().recompute_blocks]
    assert unbound[0] + 3 * unbound[1] + unbound[2] > 10, "the row must bind"
    ilp = MixedSplitILP(free, 6, host=row)
    assert ilp.parametric() is None
    sol = ilp.solve(method=method)
    est = evaluate_with_host(free, list(sol.chunk_blocks), 1.0, 1.0, roomy, recompute_blocks=sol.recompute_blocks)
    counts = [sum(c) for c in sol.recompute_blocks]
    assert counts[0] + 3 * counts[1] + counts[2] <= 10 and est.fits
    assert est.step_time_s == pytest.approx(best, rel=1e-6)
