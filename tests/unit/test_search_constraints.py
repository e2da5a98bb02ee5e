"""User constraints, sweeps, the direct solution of small split programs and the no-fit hint."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import pytest

from autopar.cluster import Link, load_cluster
from autopar.cost.stage import build_terms
from autopar.cost.step import evaluate
from autopar.errors import AutoparError, InfeasibleError
from autopar.models.gpt import GPTConfig
from autopar.reference import gpt_graph, gpt_model_path
from autopar.search.driver import search_plans
from autopar.search.hints import infeasible_hint
from autopar.search.ilp import MAX_ENUMERATED_SPLITS, SplitILP, solve_split, valid_split
from autopar.search.search import search
from autopar.search.space import SearchSpace, enumerate_configs

REPO_EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples"
SMALL = GPTConfig(num_layers=8, hidden_size=128, num_heads=4, seq_len=64, vocab_size=256)


def _cluster(memory_mib: float, gpus_per_node: int):
    a100 = load_cluster("a100-80g")
    return dataclasses.replace(a100, memory_margin_fraction=0.0, memory_bytes=memory_mib * 2**20, framework_reserve_bytes=0.0,
                               nccl_bytes_per_group=0.0,
                               gpus_per_node=gpus_per_node, name=f"tiny-{memory_mib}")


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _admits(cfg, c: dict) -> bool:
    """The constraint, read independently of space.py: what each flag means for one config."""
    pipelined = cfg.pp > 1
    return ((cfg.dp in c.get("dp", [cfg.dp])) and cfg.tp in c.get("tp", [cfg.tp]) and cfg.pp in c.get("pp", [cfg.pp])
            and cfg.cp in c.get("cp", [cfg.cp]) and cfg.zero in c.get("zero", [cfg.zero])
            and cfg.recompute in c.get("recompute", [cfg.recompute])
            and cfg.micro_batch in c.get("micro_batch", [cfg.micro_batch])
            and (cfg.tp == 1 or cfg.sequence_parallel in c.get("sp", [cfg.sequence_parallel]))
            and (not pipelined or cfg.schedule in c.get("schedule", [cfg.schedule]))
            and (not pipelined or cfg.virtual_stages in c.get("virtual_stages", [cfg.virtual_stages])))


def brute_force(graph, cluster, space, constraint: dict) -> float:
    """The unconstrained space, filtered by ``constraint``, every split costed: the fastest that fits."""
    flops = graph.model_flops_per_sample() * space.global_batch
    tokens = space.global_batch * space.seq_len
    best = math.inf
    for cfg in enumerate_configs(graph, space, Counter()):
        if not _admits(cfg, constraint):
            continue
        terms = build_terms(graph, cluster, cfg)
        for split in _compositions(graph.num_blocks, cfg.pp * cfg.virtual_stages):
            if valid_split(split, cfg.pp):
                est = evaluate(terms, split, flops, tokens, cluster.peak_flops)
                if est.fits and est.step_time_s < best:
                    best = est.step_time_s
    return best


_FIELD = {"dp": "dp_degrees", "tp": "tp_degrees", "pp": "pp_degrees", "cp": "cp_degrees", "zero": "zero_stages",
          "recompute": "recompute_modes", "schedule": "schedules", "sp": "sequence_parallel",
          "virtual_stages": "virtual_stages"}

CASES = [
    # (gpus, gpus/node, memory MiB, constraint)
    (8, 4, 48, {"tp": [2], "pp": [2]}),
    (8, 4, 48, {"pp": [2, 4], "schedule": ["interleaved-1f1b"]}),
    (8, 8, 40, {"zero": [1], "recompute": ["full"]}),
    (16, 4, 32, {"dp": [2, 4], "sp": [False]}),
    (8, 4, 64, {"cp": [2], "micro_batch": [2]}),
    (8, 8, 40, {"pp": [4], "virtual_stages": [2]}),
]


@pytest.mark.parametrize("gpus,gpn,mem,constraint", CASES)
def test_constrained_search_equals_brute_force(gpus, gpn, mem, constraint) -> None:
    graph = gpt_graph(SMALL)
    cluster = _cluster(mem, gpn)
    mbs = tuple(constraint.get("micro_batch", (1, 2, 4)))
    fields = {_FIELD[k]: tuple(v) for k, v in constraint.items() if k != "micro_batch"}
    space = SearchSpace(num_gpus=gpus, gpus_per_node=gpn, global_batch=16, seq_len=64, micro_batches=mbs,
                        max_virtual_stages=4, **fields)
    result = search(graph, cluster, space, top_k=3)
    full = SearchSpace(num_gpus=gpus, gpus_per_node=gpn, global_batch=16, seq_len=64, micro_batches=(1, 2, 4),
                       max_virtual_stages=4)
    expected = brute_force(graph, cluster, full, constraint)
    assert math.isfinite(expected), "each case must have a constrained plan that fits"
    assert result.top and result.optimal
    assert result.top[0].step_time_s == pytest.approx(expected, rel=1e-7)
    assert all(_admits(c.config, constraint) for c in result.top)


def test_constraints_are_recorded_in_plan_and_table() -> None:
    from autopar.cluster import load_cluster as lc
    from autopar.plan import dump_plan, parse_plan
    from autopar.search.result import result_report

    found = search_plans(str(gpt_model_path(SMALL)), gpus=8, cluster=lc("a100-80g"), cluster_ref="a100-80g",
                         global_batch=16, constraints={"tp": (2,), "sp": (True,)}, top_k=2)
    assert all(p.parallel.tp == 2 and p.parallel.sequence_parallel for p in found.plans)
    text = dump_plan(found.plans[0])
    assert "fixed_by_user" in text
    assert parse_plan(text).parallel == found.plans[0].parallel  # v1 loads it: prediction is ignored
    assert found.plans[0].prediction["search"]["fixed_by_user"] == {"tp": [2], "sp": [True]}
    report = result_report(found.result, list(found.plans), found.graph, found.cluster, found.space, found.fixed)
    assert "fixed    tp 2, sp on" in report and " tp*" in report and " sp*" in report


def test_impossible_constraint_is_a_one_line_error() -> None:
    with pytest.raises(AutoparError, match="--tp 3") as err:
        search_plans(str(gpt_model_path(SMALL)), gpus=8, cluster=load_cluster("a100-80g"), cluster_ref="a100-80g",
                     constraints={"tp": (3,)})
    assert not isinstance(err.value, InfeasibleError) and "\n" not in str(err.value)


def test_a_pinned_mode_that_is_only_dominated_is_not_called_too_large(tmp_path) -> None:
    """Selective recompute pinned on a model whose attention keeps no s^2 activations: the search
    drops it as dominated (it keeps what none keeps, in more time). The error says so, not "no plan
    fits N GiB" beside a smallest plan far below N."""
    from autopar.models.llama import LlamaConfig, model_file

    path = tmp_path / "llama.py"
    path.write_text(model_file(LlamaConfig(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2,
                                           ffn_hidden_size=256, seq_len=64, vocab_size=256)), encoding="utf-8")
    with pytest.raises(AutoparError, match="selective recompute saves nothing") as err:
        search_plans(str(path), gpus=2, cluster=load_cluster("a100-80g"), cluster_ref="a100-80g",
                     constraints={"recompute": ("selective",)})
    assert not isinstance(err.value, InfeasibleError) and "\n" not in str(err.value)
    assert "--recompute selective" in str(err.value)


def test_sweep_row_equals_the_single_point_plan() -> None:
    from autopar.plan import dump_plan
    from autopar.search.sweep import run_sweep, sweep_points, sweep_report

    a100 = load_cluster("a100-80g")
    path = str(gpt_model_path(SMALL))

    def point(n, batch, seq):
        return search_plans(path, gpus=n, cluster=a100, cluster_ref="a100-80g", global_batch=batch, seq_len=seq)

    done = run_sweep(sweep_points([4, 8, 16], [None], [None]), point)
    for p in done:
        alone = search_plans(path, gpus=p.gpus, cluster=a100, cluster_ref="a100-80g")
        assert dump_plan(p.found.plans[0]) == dump_plan(alone.plans[0])
    table = sweep_report(done)
    assert table.splitlines()[2].split()[-1] == "100.0"  # the first point is the reference
    assert len(table.splitlines()) == 2 + 3


def test_sweep_cli_prints_one_table_and_writes_each_plan(tmp_path, monkeypatch) -> None:
    from autopar.commands.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    rc = main(["plan", str(gpt_model_path(SMALL)), "--gpus", "4,8", "--global-batch", "16,32", "--quiet",
               "--tp", "1,2", "-o", str(tmp_path / "plans")])
    assert rc == 0
    written = sorted(p.name for p in (tmp_path / "plans").iterdir())
    assert len(written) == 4 and all("-gb" in n for n in written)


# ------------------------------------------------------------- small split programs


def _tight_terms():
    """The memory-tight case of issue 17: 8-block GPT, 16 GPUs, slow inter-node links, 40 GiB."""
    graph = gpt_graph(GPTConfig(num_layers=8, hidden_size=4096, num_heads=32, seq_len=2048, vocab_size=51200))
    a100 = load_cluster("a100-80g")
    slow = dataclasses.replace(a100, name="slow", memory_margin_fraction=0.0, memory_bytes=40 * 2**30,
                               inter_node=Link(bandwidth_bytes_per_s=1e9, latency_s=2e-5))
    space = SearchSpace(num_gpus=16, gpus_per_node=8, global_batch=64, seq_len=2048, micro_batches=(1, 2))
    return graph, slow, space


def test_enumeration_equals_cp_sat_on_every_small_program() -> None:
    graph, cluster, space = _tight_terms()
    checked = 0
    for cfg in enumerate_configs(graph, space, Counter()):
        if cfg.pp < 2 or cfg.zero not in (0, 3) or cfg.micro_batch != 1:
            continue
        terms = build_terms(graph, cluster, cfg)
        ilp = SplitILP(terms, graph.num_blocks)
        assert ilp.count_splits() <= MAX_ENUMERATED_SPLITS
        direct = solve_split(terms, graph.num_blocks, method="enumeration")
        cpsat = solve_split(terms, graph.num_blocks, method="cp-sat")
        assert (direct.chunk_blocks is None) == (cpsat.chunk_blocks is None)
        if direct.chunk_blocks is None:
            continue
        assert direct.method == "enumeration" and direct.status == "OPTIMAL"
        assert direct.objective_s == pytest.approx(cpsat.objective_s, rel=1e-9, abs=1e-12)
        para = solve_split(terms, graph.num_blocks, method="parametric")
        assert para.method == "parametric" and para.objective_s == pytest.approx(direct.objective_s, rel=1e-12)
        checked += 1
        if checked == 8:  # CP-SAT is the slow side here (that is the point): enough programs
            break
    assert checked == 8


@pytest.mark.parametrize("seed", range(4))
def test_count_splits_closed_form_equals_the_walk(seed) -> None:
    """Where no rank's cap binds, the count is the compositions of the spare blocks; with caps, the
    prefix-sum recursion. Both equal walking every split (``_splits``), capped past the limit."""
    import random

    rng = random.Random(seed)
    for _ in range(200):
        pp, limit = rng.randint(1, 5), rng.choice([5, 50, 4096])
        num_blocks = rng.randint(pp, 14)
        bounds = [(rng.randint(1, 2), rng.randint(1, num_blocks)) for _ in range(pp)]
        if rng.random() < 0.5:  # caps that never bind: the closed form's case
            bounds = [(lo, num_blocks) for lo, _ in bounds]
        ilp = SplitILP.__new__(SplitILP)
        ilp.L, ilp._bounds_memo, ilp._count_memo = num_blocks, bounds, {}
        assert ilp.count_splits(limit) == min(limit + 1, len(list(ilp._splits())))


def test_count_splits_matches_the_enumeration() -> None:
    graph, cluster, space = _tight_terms()
    ilps = (SplitILP(build_terms(graph, cluster, c), graph.num_blocks) for c in enumerate_configs(graph, space, Counter())
            if c.pp == 4 and c.virtual_stages == 1)
    ilp = next(i for i in ilps if i.count_splits() > 1)
    cfg = ilp.cfg
    assert ilp.count_splits() == len(list(ilp._splits()))
    assert all(sum(n) == 8 for n in ilp._splits())
    # the pruned walk finds the minimum of the exhaustive one
    best = min(ilp._objective(n) for n in ilp._splits())
    sol = ilp.enumerate()
    assert sol.objective_s == (best + ilp.constant_ns) / (ilp.ns * cfg.virtual_stages)


def test_pruned_enumeration_equals_exhaustive_on_larger_programs() -> None:
    graph = gpt_graph(GPTConfig(num_layers=20, hidden_size=128, num_heads=4, seq_len=64, vocab_size=256))
    cluster = _cluster(40, 5)
    space = SearchSpace(num_gpus=5, gpus_per_node=5, global_batch=20, seq_len=64, micro_batches=(1, 2))
    checked = 0
    for cfg in enumerate_configs(graph, space, Counter()):
        if cfg.pp != 5:
            continue
        ilp = SplitILP(build_terms(graph, cluster, cfg), graph.num_blocks)
        splits = list(ilp._splits())
        sol = ilp.enumerate()
        if not splits:
            assert sol.chunk_blocks is None
            continue
        best = min(ilp._objective(n) for n in splits)
        assert sol.objective_s == (best + ilp.constant_ns) / (ilp.ns * cfg.virtual_stages)
        assert ilp.parametric().objective_s == sol.objective_s
        checked += 1
    assert checked >= 4


def test_parametric_equals_cp_sat_on_gpt3_programs() -> None:
    """GPT-3 175B's split programs at 64 GPUs (pp 4-32, 96 blocks: too many splits to walk)."""
    from autopar.cluster import load_cluster as lc
    from autopar.graph.cache import cached_graph

    graph, _ = cached_graph(str(REPO_EXAMPLES / "gpt.py"), seq_len=None, dtype="bf16")
    cluster = lc("a100-80g")
    space = SearchSpace(num_gpus=64, gpus_per_node=8, global_batch=2048, seq_len=2048, micro_batches=(1, 2))
    checked = 0
    for cfg in enumerate_configs(graph, space, Counter()):
        if cfg.pp < 4 or cfg.virtual_stages % 5 != 1 or cfg.recompute != "full":
            continue
        ilp = SplitILP(build_terms(graph, cluster, cfg), graph.num_blocks)
        if sum(ilp.caps) < graph.num_blocks or min(ilp.caps) < cfg.virtual_stages:
            continue
        if ilp.count_splits() <= MAX_ENUMERATED_SPLITS:  # memory leaves few splits: the walk's case
            continue
        para = ilp.parametric()
        cpsat = solve_split(ilp.terms, graph.num_blocks, method="cp-sat", time_limit_s=30)
        assert cpsat.status == "OPTIMAL"
        assert para.objective_s == pytest.approx(cpsat.objective_s, rel=1e-9)
        assert valid_split(para.chunk_blocks, cfg.pp) and sum(para.chunk_blocks) == graph.num_blocks
        checked += 1
        if checked == 12:
            break
    assert checked == 12


# ------------------------------------------------------------- the no-fit hint


def test_no_fit_hint_names_only_remedies_that_fit() -> None:
    graph = gpt_graph(GPTConfig(num_layers=8, hidden_size=1024, num_heads=8, seq_len=1024, vocab_size=50304))
    h200 = load_cluster("h200-141g")
    # 0.42 GiB: too little for one GPU, enough for 8 (0.3 was, until a pipeline's ZeRO-3 held its
    # last reduce-scatter input across micro-batches in the price; 0.4, until the chunk outputs
    # torch pipelining keeps until their backward and FSDP2's unit gradients at the op that peaks were)
    tight = dataclasses.replace(h200, memory_margin_fraction=0.0, memory_bytes=0.42 * 2**30, framework_reserve_bytes=0.0,
                                nccl_bytes_per_group=0.0)
    space = SearchSpace(num_gpus=1, gpus_per_node=1, global_batch=8, seq_len=1024, micro_batches=(1,))
    hint = infeasible_hint(graph, tight, space, {}, user_batch=False)
    assert "--gpus" in hint
    assert "--cluster a100-80g" in hint  # the least memory above 0.42 GiB that fits; CPU profiles never named
    hopeless = dataclasses.replace(h200, memory_margin_fraction=0.0, memory_bytes=2**30 * 141)
    huge = gpt_graph(GPTConfig(num_layers=8, hidden_size=12288, num_heads=96, seq_len=2048, vocab_size=51200))
    one = SearchSpace(num_gpus=1, gpus_per_node=1, global_batch=8, seq_len=2048, micro_batches=(1,))
    hint = infeasible_hint(huge, hopeless, one, {}, user_batch=False)
    assert "--cluster" not in hint and "--gpus" in hint  # already the largest profile: never suggested
    constrained = infeasible_hint(huge, hopeless, dataclasses.replace(one, num_gpus=2, zero_stages=(0,)),
                                  {"zero": (0,)}, user_batch=False)
    assert "drop the constraints (--zero)" in constrained
