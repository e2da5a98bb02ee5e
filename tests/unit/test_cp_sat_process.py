"""The forked CP-SAT solver of one-shot commands (autopar.search.cp_sat_process): the same answers
as solving in this process, the parent never imports OR-Tools, the child is gone after the block,
and a program the child cannot take, or a child that stops answering, is solved locally.

Each check runs in a fresh interpreter: the child only starts before OR-Tools is imported, and this
test process has imported it long ago. The fallback and the stuck child share one interpreter (the
fallback first: the child it leaves alive is the one that then stops answering); the plain run,
which checks that the parent never imports OR-Tools, has one of its own."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform != "linux" or (os.cpu_count() or 1) < 2,
                                reason="the forked solver runs on Linux with two CPUs or more")

SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys
    MODES = sys.argv[1].split(",")
    from collections import Counter
    from autopar.cluster import load_cluster
    from autopar.cost.stage import build_terms
    from autopar.models.gpt import GPTConfig
    from autopar.reference import gpt_graph
    from autopar.search import cp_sat_process
    from autopar.search.ilp import SplitILP
    from autopar.search.ilp_recompute import MixedSplitILP
    from autopar.search.space import SearchSpace, enumerate_configs, mix_modes

    graph = gpt_graph(GPTConfig(num_layers=12, hidden_size=2048, num_heads=16, seq_len=2048, vocab_size=51200))
    cluster = load_cluster("a100-80g")
    space = SearchSpace(num_gpus=16, gpus_per_node=8, global_batch=64, seq_len=2048, micro_batches=(1,))
    cfgs = [c for c in enumerate_configs(graph, space, Counter()) if c.pp == 4 and c.recompute == "none"][:3]
    assert cfgs, "no pp 4 config"

    def split_programs():
        return [SplitILP(build_terms(graph, cluster, c), graph.num_blocks) for c in cfgs]

    def mixed_program():
        c = dataclasses.replace(cfgs[0], recompute="mixed")
        return MixedSplitILP(build_terms(graph, cluster, c), graph.num_blocks, mix_modes(graph))

    def answer(sol):
        # Status and optimum; the split itself may differ between two solves where splits tie
        # (CP-SAT's parallel workers), so only its size is compared.
        assert sol.chunk_blocks is not None and sum(sol.chunk_blocks) == graph.num_blocks
        return [sol.status, round(sol.objective_s, 12)]

    import os, time
    parent = os.getpid()

    class Stuck(SplitILP):  # defined before the fork, so the child can unpickle it
        def solve_cp_sat(self, time_limit_s):
            if os.getpid() != parent:  # the child hangs; solved here it answers at once
                time.sleep(30)
            return super().solve_cp_sat(time_limit_s)

    out = {}
    with cp_sat_process.overlapped():
        out["child"] = cp_sat_process._ACTIVE is not None
        child = cp_sat_process._ACTIVE
        out["remote"] = [answer(p.solve(10.0, "cp-sat")) for p in split_programs()]
        out["remote_mixed"] = answer(mixed_program().solve(10.0, "cp-sat"))
        if "fallback" in MODES:
            bad = split_programs()[0]
            bad.unpicklable = lambda: None  # the child cannot take it: solved here instead
            out["fallback"] = answer(bad.solve(10.0, "cp-sat"))
            out["fallback_imported_ortools"] = cp_sat_process.CP_SAT_MODULE in sys.modules
        if "stuck" in MODES:
            cp_sat_process.CHILD_GRACE_S = 1.0
            p = split_programs()[0]
            stuck = Stuck(p.terms, p.L)
            t0 = time.perf_counter()
            out["stuck"] = answer(stuck.solve(1.0, "cp-sat"))
            out["stuck_s"] = time.perf_counter() - t0
            out["lost"] = child.lost and not child.process.is_alive()
            out["after_lost"] = answer(split_programs()[1].solve(10.0, "cp-sat"))
        out["parent_imported_ortools"] = cp_sat_process.CP_SAT_MODULE in sys.modules
    out["child_alive_after"] = child is not None and child.process.is_alive()
    out["local"] = [answer(p.solve(10.0, "cp-sat")) for p in split_programs()]
    out["local_mixed"] = answer(mixed_program().solve(10.0, "cp-sat"))
    print(json.dumps(out))
""")


@functools.lru_cache(maxsize=None)
def _run(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("AUTOPAR_CP_SAT_PROCESS", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_forked_solver_gives_the_local_answers_and_closes() -> None:
    out = _run("plain")
    assert out["child"], "no solver process started"
    assert not out["parent_imported_ortools"]  # every program went to the child
    assert out["remote"] == out["local"]
    assert out["remote_mixed"] == out["local_mixed"]
    assert not out["child_alive_after"]


def test_a_program_the_child_cannot_take_is_solved_here() -> None:
    out = _run("fallback,stuck")
    assert out["child"] and out["fallback_imported_ortools"]  # the fallback imported OR-Tools here
    assert out["fallback"] == out["local"][0]
    assert out["remote"] == out["local"] and not out["child_alive_after"]


def test_a_child_that_stops_answering_is_abandoned() -> None:
    out = _run("fallback,stuck")
    assert out["stuck"] == out["local"][0] and out["stuck_s"] < 20  # not the child's 30 s
    assert out["lost"]  # killed, and what follows is solved here
    assert out["after_lost"] == out["local"][1] and out["parent_imported_ortools"]


def test_plan_command_writes_the_same_plan_with_and_without_the_child(tmp_path) -> None:
    model = REPO / "examples" / "gpt.py"
    plans = []
    for flag in ("1", "0"):
        out = tmp_path / f"plan{flag}.yaml"
        env = dict(os.environ, PYTHONPATH=str(REPO), AUTOPAR_CP_SAT_PROCESS=flag,
                   XDG_CACHE_HOME=str(tmp_path / "cache"))
        res = subprocess.run([sys.executable, "-m", "autopar", "plan", str(model), "--gpus", "64", "--quiet",
                              "-o", str(out)], capture_output=True, text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stderr
        plans.append(out.read_text())
    assert plans[0] == plans[1]
