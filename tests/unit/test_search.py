"""The search: the ILP answer equals brute force, and it rediscovers what practitioners know."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import pytest

from autopar.cluster import Link, load_cluster
from autopar.cost.stage import build_terms
from autopar.cost.step import evaluate
from autopar.graph import build_graph
from autopar.models.gpt import GPTConfig
from autopar.models.llama import LlamaConfig
from autopar.models.llama import model_file as llama_model_file
from autopar.reference import gpt_graph
from autopar.search.ilp import deal_chunks, solve_split, valid_split
from autopar.search.search import search
from autopar.search.space import SearchSpace, enumerate_configs


def _compositions(total: int, parts: int):
    """All ways to write ``total`` as ``parts`` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def brute_force(graph, cluster, space):
    """Every legal config x every contiguous split (chunks of a rank within one block of each
    other), costed with cost.step.evaluate; the fastest that fits memory."""
    flops = graph.model_flops_per_sample() * space.global_batch
    tokens = space.global_batch * space.seq_len
    best = math.inf
    for cfg in enumerate_configs(graph, space, Counter()):
        terms = build_terms(graph, cluster, cfg)
        chunks = cfg.pp * cfg.virtual_stages
        for split in _compositions(graph.num_blocks, chunks):
            if not valid_split(split, cfg.pp):
                continue
            est = evaluate(terms, split, flops, tokens, cluster.peak_flops)
            if est.fits and est.step_time_s < best:
                best = est.step_time_s
    return best


def _tiny_cluster(memory_bytes: float, gpus_per_node: int = 4):
    a100 = load_cluster("a100-80g")
    return dataclasses.replace(a100, memory_bytes=memory_bytes, framework_reserve_bytes=0.0, nccl_bytes_per_group=0.0,
                               gpus_per_node=gpus_per_node, name=f"tiny-{memory_bytes:.0f}")


GRID = [
    # (layers, heads, gpus, gpus/node, global batch, memory MiB)
    (4, 4, 4, 4, 16, 64),
    (6, 4, 8, 4, 16, 48),
    (8, 4, 8, 8, 32, 40),
    (8, 2, 16, 4, 32, 32),
    (5, 4, 2, 2, 8, 64),
    (8, 4, 16, 8, 16, 24),
]


@pytest.mark.parametrize("layers,heads,gpus,gpn,gbs,mem_mib", GRID)
def test_ilp_search_equals_brute_force(layers, heads, gpus, gpn, gbs, mem_mib) -> None:
    graph = gpt_graph(GPTConfig(num_layers=layers, hidden_size=128, num_heads=heads, seq_len=64, vocab_size=256))
    cluster = _tiny_cluster(mem_mib * 2**20, gpn)
    space = SearchSpace(num_gpus=gpus, gpus_per_node=gpn, global_batch=gbs, seq_len=64, micro_batches=(1, 2, 4),
                        max_virtual_stages=4)
    result = search(graph, cluster, space, top_k=3)
    expected = brute_force(graph, cluster, space)
    if math.isinf(expected):
        assert not result.top
        return
    assert result.top, "brute force found a plan that fits but the search did not"
    assert result.optimal
    assert result.top[0].step_time_s == pytest.approx(expected, rel=1e-7)
    times = [c.step_time_s for c in result.top]
    assert times == sorted(times)


def test_grid_has_cases_where_memory_binds() -> None:
    """The oracle comparison must exercise the memory family: some configs are rejected for memory."""
    graph = gpt_graph(GPTConfig(num_layers=8, hidden_size=128, num_heads=4, seq_len=64, vocab_size=256))
    space = SearchSpace(num_gpus=16, gpus_per_node=8, global_batch=16, seq_len=64, micro_batches=(1, 2, 4),
                        max_virtual_stages=4)
    result = search(graph, _tiny_cluster(24 * 2**20, 8), space)
    assert any(k.startswith("memory") for k in result.rejected)


def test_ilp_uneven_split_beats_even_when_the_head_is_heavy() -> None:
    """A large vocabulary makes the last stage heavy: the ILP moves blocks off it (Galvatron can't)."""
    graph = gpt_graph(GPTConfig(num_layers=8, hidden_size=1024, num_heads=8, seq_len=256, vocab_size=65536))
    cluster = _tiny_cluster(2**36)
    cfg = next(c for c in enumerate_configs(graph, SearchSpace(num_gpus=4, gpus_per_node=4, global_batch=16,
                                                                seq_len=256, micro_batches=(1,)), Counter())
               if c.pp == 4 and c.schedule == "1f1b" and c.zero == 0 and c.recompute == "none")
    terms = build_terms(graph, cluster, cfg)
    sol = solve_split(terms, 8)
    assert sol.status == "OPTIMAL" and sol.objective_s == pytest.approx(sol.bound_s)
    assert sol.chunk_blocks[-1] < sol.chunk_blocks[1], sol.chunk_blocks
    even = evaluate(terms, [2, 2, 2, 2], 1.0, 1.0, cluster.peak_flops).step_time_s
    best = evaluate(terms, list(sol.chunk_blocks), 1.0, 1.0, cluster.peak_flops).step_time_s
    assert best < even


def test_deal_chunks_round_robin_and_balanced() -> None:
    assert deal_chunks([5, 3], 2) == (2, 1, 3, 2)  # rank 0: 2 then 3 blocks, rank 1: 1 then 2 (larger last)
    assert valid_split(deal_chunks([7, 4, 9], 3), 3)
    assert not valid_split([3, 1, 1, 1], 2)


# ----------------------------------------------------------------- rediscovery


def _best(graph, cluster, **space_kw):
    space = SearchSpace(**space_kw)
    result = search(graph, cluster, space, top_k=5)
    assert result.top, result.rejected
    return result, result.top[0].config


def test_small_model_with_ample_memory_is_plain_data_parallel() -> None:
    graph = gpt_graph(GPTConfig(num_layers=12, hidden_size=768, num_heads=12, seq_len=1024, vocab_size=50304))
    """GPT-2 small on one node: data parallelism only. ZeRO-2 ties with ZeRO-1 here (its per-micro-batch
    reduce-scatter hides behind backward on NVLink), so the check is that a plain DP plan (ZeRO 0/1) is
    ranked and within 0.1 % of the best, and that no plan in the top uses model parallelism."""
    result, best = _best(graph, load_cluster("a100-80g"), num_gpus=8, gpus_per_node=8, global_batch=256,
                         seq_len=1024, micro_batches=(1, 2, 4, 8))
    assert all((c.config.tp, c.config.pp, c.config.cp, c.config.dp) == (1, 1, 1, 8) for c in result.top)
    plain = [c for c in result.top if c.config.zero in (0, 1)]
    assert plain and plain[0].step_time_s <= result.top[0].step_time_s * 1.001


def test_model_too_large_for_one_gpu_gets_zero3_or_model_parallelism() -> None:
    graph = gpt_graph(GPTConfig(num_layers=40, hidden_size=5120, num_heads=40, seq_len=2048, vocab_size=51200))
    assert graph.num_params * 16 > 80 * 2**30  # 13B: model states alone need ~200 GiB
    _, best = _best(graph, load_cluster("a100-80g"), num_gpus=16, gpus_per_node=8, global_batch=128, seq_len=2048,
                    micro_batches=(1, 2))
    assert best.zero == 3 or best.tp > 1 or best.pp > 1


def test_long_sequence_gets_context_parallelism() -> None:
    cfg = LlamaConfig(num_layers=8, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                      seq_len=131072, vocab_size=128256)
    path = _write(llama_model_file(cfg), "llama_128k")
    graph = build_graph(str(path))
    _, best = _best(graph, load_cluster("a100-80g"), num_gpus=32, gpus_per_node=8, global_batch=8, seq_len=131072,
                    micro_batches=(1,))
    assert best.cp > 1


def test_slow_network_keeps_tp_inside_the_node_and_pp_or_zero_across() -> None:
    a100 = load_cluster("a100-80g")
    slow = dataclasses.replace(a100, name="slow-net", inter_node=Link(bandwidth_bytes_per_s=1e9, latency_s=2e-5))
    graph = gpt_graph(GPTConfig(num_layers=24, hidden_size=4096, num_heads=32, seq_len=2048, vocab_size=51200))
    _, best = _best(graph, slow, num_gpus=32, gpus_per_node=8, global_batch=128, seq_len=2048,
                    micro_batches=(1, 2, 4))
    inner = best.tp * best.cp
    assert inner <= 8, "tensor/context groups must not span nodes"
    across = 32 // inner
    assert best.pp > 1 or best.zero >= 1, f"{across} ranks across nodes need pp or ZeRO, got {best}"
    # Data-parallel gradients over a 1 GB/s network are what the plan must avoid.
    assert best.pp * inner >= 8 or best.zero >= 1


def test_tp_that_does_not_divide_heads_is_never_chosen() -> None:
    graph = gpt_graph(GPTConfig(num_layers=8, hidden_size=768, num_heads=12, seq_len=1024, vocab_size=50304))
    result, _ = _best(graph, load_cluster("a100-80g"), num_gpus=16, gpus_per_node=8, global_batch=64,
                      seq_len=1024, micro_batches=(1, 2))
    assert all(12 % c.config.tp == 0 for c in result.top)
    assert result.rejected.get("tp does not divide heads", 0) >= 1


def _write(source: str, name: str):
    import hashlib
    import tempfile
    from pathlib import Path

    path = Path(tempfile.gettempdir()) / "autopar-models" / f"{name}_{hashlib.sha256(source.encode()).hexdigest()[:12]}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")
    return path


def test_zero1_and_zero2_are_searched_at_every_tp_and_zero2_not_twice_with_pp() -> None:
    from collections import Counter

    graph = gpt_graph(GPTConfig(num_layers=8, hidden_size=1024, num_heads=16, seq_len=1024, vocab_size=50304))
    space = SearchSpace(num_gpus=16, gpus_per_node=8, global_batch=64, seq_len=1024, micro_batches=(1, 2),
                        dtype_bytes=2, optimizer="adam")
    configs = list(enumerate_configs(graph, space, Counter()))
    for tp in (1, 2, 8):
        flat = {c.zero for c in configs if c.tp == tp and c.pp == 1 and c.dp * c.cp > 1}
        assert {1, 2} <= flat, (tp, flat)
    # ZeRO-2 at pp > 1 runs as ZeRO-1 (cost.zero.executed_zero): the same plan would be searched twice
    assert not [c for c in configs if c.pp > 1 and c.zero == 2]
    assert [c for c in configs if c.pp > 1 and c.tp > 1 and c.zero == 1]


def test_parametric_screen_gives_the_plans_cp_sat_alone_gives(monkeypatch) -> None:
    """Split programs too large to enumerate (48 blocks over up to 16 ranks) are screened by the
    exact parametric method and only the top K go to CP-SAT: the plans, splits' step times and
    ranking equal those of CP-SAT solving every program, and the reported splits are CP-SAT's."""
    import autopar.search.ilp as ilp

    graph = gpt_graph(GPTConfig(num_layers=48, hidden_size=128, num_heads=4, seq_len=64, vocab_size=256))
    cluster = _tiny_cluster(24 * 2**20, 8)
    space = SearchSpace(num_gpus=16, gpus_per_node=8, global_batch=32, seq_len=64, micro_batches=(1, 2),
                        max_virtual_stages=2, refine_recompute_mix=False)
    screened = search(graph, cluster, space, top_k=4)
    assert any(c.config.pp >= 4 for c in screened.top), "the case must exercise large split programs"
    assert all(c.split_method in ("cp-sat", "enumeration", "direct") for c in screened.top)
    assert any(c.split_method == "cp-sat" for c in screened.top)
    monkeypatch.setattr(ilp.SplitILP, "parametric", lambda self: None)
    plain = search(graph, cluster, space, top_k=4)
    assert [c.step_time_s for c in screened.top] == pytest.approx([c.step_time_s for c in plain.top], rel=1e-9)
    assert [c.config for c in screened.top] == [c.config for c in plain.top]
    assert screened.num_ilp_solved <= plain.num_ilp_solved


def test_memory_capped_bound_is_the_least_time_at_which_the_ranks_hold_every_block() -> None:
    """``_least_max_time`` (a breakpoint walk) against the bisection it replaced, run to convergence."""
    import random

    from autopar.search.search import _least_max_time

    def bisection(caps, fixed, tau, blocks):
        def room(t):
            return sum(min(c, max(0.0, (t - f) / tau)) for c, f in zip(caps, fixed))
        lo, hi = max(fixed), max(fixed) + tau * blocks
        for _ in range(80):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if room(mid) < blocks else (lo, mid)
        return lo

    rng = random.Random(7)
    for _ in range(3000):
        pp, blocks = rng.randint(1, 12), rng.randint(1, 96)
        caps = [rng.randint(0, blocks) for _ in range(pp)]
        fixed = [rng.choice([0.0, rng.random() * 5]) for _ in range(pp)]
        tau = rng.random() * 2 + 0.01
        assert _least_max_time(caps, fixed, tau, blocks) == pytest.approx(bisection(caps, fixed, tau, blocks),
                                                                          rel=1e-9, abs=1e-9)


def test_the_pre_build_capacity_bound_never_undercuts_the_real_capacities() -> None:
    """search.fit_bound: capacities from the branch's shared terms are at least those of every
    config's own terms (so skipping a build where they cannot hold L blocks loses no plan)."""
    from autopar.cluster import load_cluster
    from autopar.search.ilp import rank_block_capacity
    from autopar.search.search import _upper_capacity
    from autopar.search.space import enumerate_branches

    graph = gpt_graph(GPTConfig(num_layers=16, hidden_size=1024, num_heads=16, seq_len=1024, vocab_size=512), "bf16")
    cluster = dataclasses.replace(load_cluster("a100-80g"), memory_bytes=6 * 2**30)
    space = SearchSpace(num_gpus=16, gpus_per_node=8, global_batch=64, seq_len=1024, micro_batches=(1, 2),
                        recompute_modes=("none", "selective", "full", "mixed"))
    checked = 0
    for branch in enumerate_branches(graph, space, Counter()):
        if branch.pp == 1:
            continue
        base = build_terms(graph, cluster, branch.config(dp=branch.dp * branch.pp, pp=1))
        for zero in branch.zero_stages:
            for off in branch.offloads(zero):
                for schedule in branch.schedules:
                    terms = build_terms(graph, cluster, branch.config(*schedule, zero, offload=off))
                    real = rank_block_capacity(terms)
                    if terms.recompute_parts is not None:
                        from autopar.search.ilp_recompute import mixed_block_capacity

                        real = mixed_block_capacity(terms)
                    upper = _upper_capacity(base, branch, zero, off, schedule, cluster, graph)
                    assert all(u >= c for u, c in zip(upper, real)), (branch, zero, off, schedule, upper, real)
                    checked += 1
    assert checked > 500


def test_a_cp_rejection_names_the_models_own_reason() -> None:
    """The search's rejection line carries why the model cannot run cp (spec/support.py), not a guess."""
    graph = gpt_graph(GPTConfig(num_layers=4, hidden_size=128, num_heads=4, seq_len=64, vocab_size=256))
    graph = dataclasses.replace(graph, cp_reason="the attention uses a sliding window (16 tokens)")
    rejected: Counter = Counter()
    space = SearchSpace(num_gpus=4, gpus_per_node=4, global_batch=8, seq_len=64, micro_batches=(1,))
    assert all(c.cp == 1 for c in enumerate_configs(graph, space, rejected))
    assert rejected["cp: the attention uses a sliding window (16 tokens)"] > 0
    assert not any("not a sequence model" in k for k in rejected)
