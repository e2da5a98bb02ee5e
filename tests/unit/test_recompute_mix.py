"""Issue 14: the per-stage recompute mix -- plan field, cost model, split program, search.

The oracle is brute force over the cost model: every split x every (none, selective, full) mix of
every rank, priced by ``cost.step.evaluate``; the program's two solvers must find its optimum.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import yaml

from autopar.cluster import load_cluster
from autopar.cost.stage import Config, build_terms
from autopar.cost.step import evaluate
from autopar.errors import PlanError
from autopar.models.gpt import GPTConfig
from autopar.plan import dump_plan, parse_plan, plan_from_dict, plan_to_dict
from autopar.reference import gpt_graph
from autopar.search.ilp import solve_split, valid_split
from autopar.search.ilp_recompute import MixedSplitILP
from autopar.search.search import search
from autopar.search.space import SearchSpace, mix_modes

MODES = ("none", "selective", "full")


@pytest.fixture(scope="module")
def tiny():
    return gpt_graph(GPTConfig(num_layers=6, hidden_size=128, num_heads=4, seq_len=64, vocab_size=256))


def _cluster(mem_mib: float, overlap: bool = False):
    """a100-80g-megatron with little memory (the cases were sized on its software: no autocast weight
    copies or per-micro-batch pipeline buffers); ``overlap``: the gradient sync hides behind backward,
    so a rank's tail depends on its backward time and hence on its mix (the second tail family)."""
    return dataclasses.replace(load_cluster("a100-80g-megatron"), memory_margin_fraction=0.0, memory_bytes=mem_mib * 2**20,
                               framework_reserve_bytes=0.0,
                               nccl_bytes_per_group=0.0, overlap_grad_reduce=overlap, name=f"tiny-{mem_mib}")


def _cfg(recompute: str, pp: int, schedule: str = "1f1b", v: int = 1, dp: int = 1, zero: int = 0) -> Config:
    return Config(dp=dp, tp=1, pp=pp, cp=1, cp_kind="ring", sequence_parallel=False, zero=zero, recompute=recompute,
                  schedule=schedule, virtual_stages=v, micro_batch=2, global_batch=16 * dp, seq_len=64, dtype_bytes=2,
                  optimizer="adam")


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _mixes(n: int):
    for full in range(n + 1):
        for sel in range(n - full + 1):
            yield (n - full - sel, sel, full)


def _brute_force(terms, num_blocks: int) -> float:
    """The fastest fitting (split, mix) of a mixed config, every one priced by the cost model."""
    pp, best = terms.config.pp, math.inf
    for split in _compositions(num_blocks, pp * terms.config.virtual_stages):
        if not valid_split(split, pp):
            continue
        per_rank = [sum(split[r::pp]) for r in range(pp)]
        for mix in itertools.product(*(list(_mixes(n)) for n in per_rank)):
            est = evaluate(terms, split, 1.0, 1.0, 1.0, recompute_blocks=mix)
            if est.fits:
                best = min(best, est.step_time_s)
    return best


def _single_mode_best(graph, cluster, cfg: Config) -> float:
    sol = solve_split(build_terms(graph, cluster, cfg), graph.num_blocks, method="enumeration")
    if sol.chunk_blocks is None:
        return math.inf
    return evaluate(build_terms(graph, cluster, cfg), list(sol.chunk_blocks), 1.0, 1.0, 1.0).step_time_s


# ----------------------------------------------------------------------------- cost model


@pytest.mark.parametrize("mode", MODES)
def test_a_mix_of_one_mode_costs_what_that_mode_costs(tiny, mode) -> None:
    cluster = _cluster(64)
    single = build_terms(tiny, cluster, _cfg(mode, 2, dp=2, zero=1))
    mixed = build_terms(tiny, cluster, _cfg("mixed", 2, dp=2, zero=1))
    split = [4, 2]
    a = evaluate(single, split, 1.0, 1.0, 1.0)
    counts = [tuple(n if m == mode else 0 for m in MODES) for n in (4, 2)]
    b = evaluate(mixed, split, 1.0, 1.0, 1.0, recompute_blocks=counts)
    assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-12)
    assert b.peak_memory_bytes == pytest.approx(a.peak_memory_bytes, rel=1e-12)
    assert b.time_breakdown_s == pytest.approx(a.time_breakdown_s, rel=1e-9, abs=1e-15)


def test_mixed_terms_need_counts_that_split_each_rank(tiny) -> None:
    terms = build_terms(tiny, _cluster(64), _cfg("mixed", 2))
    with pytest.raises(ValueError, match="counts"):
        evaluate(terms, [3, 3], 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="rank 1"):
        evaluate(terms, [3, 3], 1.0, 1.0, 1.0, recompute_blocks=[(3, 0, 0), (1, 1, 0)])


# ----------------------------------------------------------------------------- the program

# (memory MiB, pp, schedule, v, dp, zero, sync overlaps): memory binds at 8-12 MiB (no single mode
# fits some); with dp > 1 and overlap the tail's second family reads each rank's backward
CASES = [
    (8, 3, "1f1b", 1, 1, 0, False),
    (10, 3, "1f1b", 1, 1, 0, False),
    (12, 2, "1f1b", 1, 1, 0, False),
    (12, 2, "interleaved-1f1b", 2, 1, 0, False),
    (16, 2, "1f1b", 1, 1, 0, False),
    (10, 2, "1f1b", 1, 2, 1, False),
    (9, 3, "gpipe", 1, 2, 0, False),
    (10, 2, "1f1b", 1, 2, 0, True),
    (12, 2, "interleaved-1f1b", 2, 2, 1, True),
    (10, 3, "1f1b", 1, 2, 1, True),
]


@pytest.mark.parametrize("mem,pp,schedule,v,dp,zero,overlap", CASES)
def test_mixed_program_equals_brute_force(tiny, mem, pp, schedule, v, dp, zero, overlap) -> None:
    cluster = _cluster(mem, overlap)
    terms = build_terms(tiny, cluster, _cfg("mixed", pp, schedule, v, dp, zero))
    expected = _brute_force(terms, tiny.num_blocks)
    for method in ("enumeration", "parametric", "cp-sat"):
        sol = MixedSplitILP(terms, tiny.num_blocks).solve(method=method)
        if math.isinf(expected):
            assert sol.chunk_blocks is None, method
            continue
        assert sol.status == "OPTIMAL", method
        est = evaluate(terms, list(sol.chunk_blocks), 1.0, 1.0, 1.0, recompute_blocks=sol.recompute_blocks)
        assert est.fits
        assert est.step_time_s == pytest.approx(expected, rel=1e-6), method
        assert sol.objective_s == pytest.approx(est.step_time_s, rel=1e-5), method


@pytest.fixture(scope="module")
def wide():
    return gpt_graph(GPTConfig(num_layers=6, hidden_size=1024, num_heads=8, seq_len=256, vocab_size=256))


# (memory MiB, dp link bytes/s, pp, schedule, v): the gradient sync outlasts the last backward, so
# recompute (a longer backward) hides more of it -- each rank's front has many (t, z) mixes
OVERLAP_CASES = [
    (720, 1e10, 2, "1f1b", 1),
    (720, 1e10, 2, "interleaved-1f1b", 2),
    (1200, 1e9, 2, "1f1b", 1),
    (900, 1e9, 3, "1f1b", 1),
]


@pytest.mark.parametrize("mem,bw,pp,schedule,v", OVERLAP_CASES)
def test_mixed_program_equals_brute_force_when_recompute_hides_the_sync(wide, mem, bw, pp, schedule, v) -> None:
    from autopar.cluster import Link

    cluster = dataclasses.replace(_cluster(mem, overlap=True), gpus_per_node=1,
                                  inter_node=Link(bandwidth_bytes_per_s=bw, latency_s=2e-5))
    cfg = dataclasses.replace(_cfg("mixed", pp, schedule, v, dp=2), seq_len=256, global_batch=4 * 2 * pp)
    terms = build_terms(wide, cluster, cfg)
    ilp = MixedSplitILP(terms, wide.num_blocks)
    assert max(len(f) for per_n in ilp.fronts() for f in per_n.values()) > 1  # the tail depends on the mix
    expected = _brute_force(terms, wide.num_blocks)
    for method in ("enumeration", "parametric", "cp-sat"):
        sol = MixedSplitILP(terms, wide.num_blocks).solve(method=method)
        est = evaluate(terms, list(sol.chunk_blocks), 1.0, 1.0, 1.0, recompute_blocks=sol.recompute_blocks)
        assert sol.status == "OPTIMAL" and est.fits, method
        assert est.step_time_s == pytest.approx(expected, rel=1e-6), method


def test_the_grid_has_cases_where_only_a_mix_is_best(tiny) -> None:
    """The oracle must exercise the mix: cases where the mixed optimum beats every single mode."""
    wins = 0
    for mem, pp, schedule, v, dp, zero, overlap in CASES:
        cluster = _cluster(mem, overlap)
        mixed = _brute_force(build_terms(tiny, cluster, _cfg("mixed", pp, schedule, v, dp, zero)), tiny.num_blocks)
        single = min(_single_mode_best(tiny, cluster, _cfg(m, pp, schedule, v, dp, zero)) for m in MODES)
        assert mixed <= single * (1 + 1e-12)
        wins += mixed < single * (1 - 1e-6)
    assert wins >= 3


def test_modes_outside_the_mix_are_never_used(tiny) -> None:
    terms = build_terms(tiny, _cluster(10), _cfg("mixed", 3))
    sol = MixedSplitILP(terms, tiny.num_blocks, ("none", "full")).solve()
    assert sol.chunk_blocks is not None
    assert all(sel == 0 for _, sel, _ in sol.recompute_blocks)


# ----------------------------------------------------------------------------- Korthikanti 530B

# Korthikanti et al. 2022 (arXiv:2205.05198), Table 3: the 530B model on 280 A100-80GB --
# 105 layers, hidden 20480, 128 heads, seq 2048, tp 8 (with SP), pp 35, dp 1, micro-batch 1,
# global batch 280. (Not among the rows of /work/shared/calibration/korthikanti_2022.yaml.)
K530 = GPTConfig(num_layers=105, hidden_size=20480, num_heads=128, seq_len=2048, vocab_size=51200)


def test_korthikanti_530b_mixed_plan_beats_every_single_mode() -> None:
    graph = gpt_graph(K530, "fp16")
    cluster = load_cluster("a100-80g")
    flops, tokens = graph.model_flops_per_sample() * 280, 280 * 2048

    def cfg(recompute: str) -> Config:
        return Config(dp=1, tp=8, pp=35, cp=1, cp_kind="ring", sequence_parallel=True, zero=0, recompute=recompute,
                      schedule="1f1b", virtual_stages=1, micro_batch=1, global_batch=280, seq_len=2048,
                      dtype_bytes=2, optimizer="adam")

    single = {}
    for mode in MODES:
        terms = build_terms(graph, cluster, cfg(mode))
        sol = solve_split(terms, 105)
        single[mode] = evaluate(terms, list(sol.chunk_blocks), flops, tokens, cluster.peak_flops).step_time_s \
            if sol.chunk_blocks else math.inf
    terms = build_terms(graph, cluster, cfg("mixed"))
    sol = MixedSplitILP(terms, 105, mix_modes(graph)).solve()
    assert sol.status == "OPTIMAL"
    est = evaluate(terms, list(sol.chunk_blocks), flops, tokens, cluster.peak_flops,
                   recompute_blocks=sol.recompute_blocks)
    print("\nKorthikanti 530B, 280 A100-80GB, tp8 sp pp35: " + ", ".join(f"{m} {t:.2f} s" for m, t in single.items())
          + f"; mixed {est.step_time_s:.2f} s, blocks (none, selective, full) "
          + str(tuple(map(sum, zip(*sol.recompute_blocks)))))
    assert est.fits
    assert est.step_time_s < min(single.values())
    used = {m for counts in sol.recompute_blocks for m, k in zip(MODES, counts) if k}
    assert len(used) >= 2, sol.recompute_blocks


# ----------------------------------------------------------------------------- search and plan


def test_search_with_mixed_writes_counts_that_estimate_prices_alike(tiny, tmp_path) -> None:
    from autopar.cost.estimate import estimate_plan
    from autopar.search.result import candidate_plan, result_report

    cluster = _cluster(7)  # where no single mode is best everywhere
    space = SearchSpace(num_gpus=3, gpus_per_node=4, global_batch=16, seq_len=64, micro_batches=(2,),
                        recompute_modes=("none", "selective", "full", "mixed"), pp_degrees=(3,), zero_stages=(0,))
    single = search(tiny, cluster, dataclasses.replace(space, recompute_modes=MODES, refine_recompute_mix=False),
                    top_k=1)
    result = search(tiny, cluster, space, top_k=3)
    best = result.top[0]
    assert best.recompute_blocks is not None and best.config.recompute == "mixed"
    assert not single.top or best.step_time_s < single.top[0].step_time_s

    class _Source:
        path, sha256 = tmp_path / "m.py", None

    plan = candidate_plan(best, _Source(), cluster.name, 4)
    text = dump_plan(plan)
    assert "recompute_blocks" in yaml.safe_load(text)["parallel"]
    again = parse_plan(text)
    assert again.parallel.recompute_blocks == best.recompute_blocks
    assert again.parallel.recompute == "full" if any(c[2] for c in best.recompute_blocks) else True
    assert estimate_plan(again, tiny, cluster).step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    assert "mix " in result_report(result, [plan], tiny, cluster, space)


# ----------------------------------------------------------------------------- plan field


def _plan_dict(**parallel):
    return {"version": 1, "model": {"file": "m.py", "num_blocks": 8},
            "cluster": {"profile": "a100-80g", "num_gpus": 2, "gpus_per_node": 8},
            "training": {"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 64},
            "parallel": {"dp": 1, "tp": 1, "pp": 2, **parallel}}


def test_old_plans_load_and_are_written_unchanged() -> None:
    data = _plan_dict(recompute="selective", stages=[[0, 3], [3, 8]])
    plan = plan_from_dict(data)
    assert plan.parallel.recompute_blocks is None
    assert plan_to_dict(plan)["parallel"] == {**data["parallel"], "cp": 1, "cp_kind": "ring",
                                              "sequence_parallel": False, "zero": 0, "pp_schedule": "1f1b",
                                              "pp_virtual_stages": 1}
    assert "recompute_blocks" not in dump_plan(plan)
    assert plan.block_recompute() == ("selective",) * 8


def test_recompute_blocks_round_trip_and_the_block_rule() -> None:
    data = _plan_dict(recompute="full", recompute_blocks=[{"none": 1, "selective": 1, "full": 1},
                                                          {"none": 4, "full": 1}], stages=[[0, 3], [3, 8]])
    plan = plan_from_dict(data)
    assert plan.parallel.recompute_blocks == ((1, 1, 1), (4, 0, 1))
    assert parse_plan(dump_plan(plan)) == plan
    # each rank's first blocks full, then selective, then none
    assert plan.block_recompute() == ("full", "selective", "none", "full", "none", "none", "none", "none")


def test_interleaved_ranks_deal_modes_in_execution_order() -> None:
    data = _plan_dict(pp_schedule="interleaved-1f1b", pp_virtual_stages=2, stages=[[0, 2], [2, 4], [4, 6], [6, 8]],
                      recompute_blocks=[{"none": 1, "selective": 1, "full": 2}, {"none": 4}])
    plan = plan_from_dict(data)
    # rank 0 holds chunks 0 and 2: blocks 0, 1, 4, 5 in execution order
    assert plan.block_recompute() == ("full", "full", "none", "none", "selective", "none", "none", "none")


@pytest.mark.parametrize("value,needle", [
    ([{"none": 3}, {"none": 4}], r"recompute_blocks\[0\] counts 3 blocks"),
    ([{"none": 4, "half": 0}, {"none": 4}], "unknown recompute mode 'half'"),
    ([{"none": 8}], "one {none: n, selective: n, full: n} mapping per pipeline rank"),
    ([{"none": 5, "full": -1}, {"none": 4}], r"recompute_blocks\[0\].full must be >= 0"),
    ([{"none": 4.0}, {"none": 4}], "must be an integer"),
    ("full", "must be a list"),
])
def test_bad_recompute_blocks_is_a_one_line_error_naming_the_key(value, needle) -> None:
    text = yaml.safe_dump(_plan_dict(recompute_blocks=value))
    with pytest.raises(PlanError, match=needle) as err:
        parse_plan(text)
    assert "parallel.recompute_blocks" in str(err.value) and "\n" not in str(err.value)


def test_estimate_and_explain_price_and_show_the_counts(tiny) -> None:
    from autopar.cost.estimate import estimate_json, estimate_plan
    from autopar.explain.explanation import explain_plan, format_explanation

    cluster = _cluster(64)
    data = {"version": 1, "model": {"file": "m.py", "num_blocks": 6},
            "cluster": {"profile": "a100-80g", "num_gpus": 2, "gpus_per_node": 8},
            "training": {"global_batch_size": 16, "micro_batch_size": 2, "seq_len": 64},
            "parallel": {"dp": 1, "tp": 1, "pp": 2, "recompute": "full", "stages": [[0, 4], [4, 6]],
                         "recompute_blocks": [{"none": 1, "selective": 1, "full": 2}, {"none": 2}]}}
    plan = plan_from_dict(data)
    est = estimate_plan(plan, tiny, cluster)
    terms = build_terms(tiny, cluster, _cfg("mixed", 2))
    assert est.step_time_s == evaluate(terms, [4, 2], 1.0, 1.0, 1.0,
                                       recompute_blocks=[(1, 1, 2), (2, 0, 0)]).step_time_s
    single = {m: estimate_plan(plan_from_dict({**data, "parallel": {**data["parallel"], "recompute": m,
                                                                   "recompute_blocks": None}}), tiny, cluster)
              for m in MODES}
    # the mix costs between no recompute and full recompute, and its ranks differ in memory
    assert single["none"].step_time_s < est.step_time_s < single["full"].step_time_s
    assert est.ranks[0].memory_bytes["activations"] < single["none"].ranks[0].memory_bytes["activations"]
    assert est.ranks[1].memory_bytes["activations"] == pytest.approx(single["none"].ranks[1].memory_bytes["activations"])
    assert estimate_json(est)["step_time_s"] == est.step_time_s
    text = format_explanation(explain_plan(plan, tiny, cluster))
    assert "recompute per stage (none 3, selective 1, full 2 blocks)" in text
    stage_lines = [line for line in text.splitlines() if "recompute full 2 selective 1 none 1" in line]
    assert len(stage_lines) == 1 and "embedding" in stage_lines[0]
    assert any("recompute none 2" in line and "head+loss" in line for line in text.splitlines())


def test_hf_attention_recomputes_only_the_selective_blocks_of_a_mix() -> None:
    """transformers attention under a mix: every layer is routed (their config is shared), only
    the selective ones (``recompute_keys``) re-run their attention in backward."""
    pytest.importorskip("transformers")
    from pathlib import Path

    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from autopar.executor.parallel import hf_attention
    from autopar.modelfile import load_model_file

    calls = []

    def counting(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("test_counting_mix", counting)
    mf = load_model_file(Path(__file__).resolve().parents[2] / "examples" / "zoo" / "hf_llama.py")
    torch.manual_seed(0)
    model = mf.build("cpu")
    model.config._attn_implementation = "test_counting_mix"
    tokens = mf.example_inputs(2, "cpu")
    assert hf_attention.install(model, "model.layers", "self_attn", recompute=True, recompute_keys={"0", "2"}) == 4
    loss = mf.loss_fn(model(tokens), tokens)
    assert sorted(calls) == [0, 1, 2, 3]
    calls.clear()
    loss.backward()
    assert sorted(calls) == [0, 2]  # backward re-ran the selective layers' attention only


def test_the_default_search_refines_its_top_plans_with_mixes(tiny) -> None:
    """Without --recompute mixed, each top-K single-mode plan is solved again as a mix of the same
    degrees: the best plan is then at least as fast as every single-mode plan, and faster here."""
    cluster = _cluster(7)  # where no single mode is best everywhere
    space = SearchSpace(num_gpus=3, gpus_per_node=4, global_batch=16, seq_len=64, micro_batches=(2,),
                        pp_degrees=(3,), zero_stages=(0,))
    single = search(tiny, cluster, dataclasses.replace(space, refine_recompute_mix=False), top_k=3)
    refined = search(tiny, cluster, space, top_k=3)
    assert single.top and refined.top
    assert refined.top[0].step_time_s < single.top[0].step_time_s
    assert refined.top[0].recompute_blocks is not None
    pinned = search(tiny, cluster, dataclasses.replace(space, recompute_modes=("none", "full")), top_k=3)
    assert all(c.recompute_blocks is None for c in pinned.top)  # a mode the user left out is never mixed in


@pytest.mark.parametrize("seed", range(6))
def test_front_combination_count_equals_walking_them(seed) -> None:
    """``_count`` (a capped convolution per rank) against every combination of one block count
    and one front entry per rank, capped at the limit the same way."""
    import random

    from autopar.search.ilp_recompute import _count

    rng = random.Random(seed)
    for _ in range(40):
        ranks, total, limit = rng.randint(1, 4), rng.randint(0, 12), rng.choice([0, 3, 50, 4096])
        fronts = [{n: [None] * rng.randint(1, 4) for n in rng.sample(range(14), rng.randint(0, 6))}
                  for _ in range(ranks)]
        walked = sum(1 for choice in itertools.product(*[[n for n, f in per_n.items() for _ in f] for per_n in fronts])
                     if sum(choice) == total)
        assert _count(fronts, total, limit) == min(limit + 1, walked)
