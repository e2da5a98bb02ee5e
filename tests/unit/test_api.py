"""The Python API: ``autopar.plan`` is both the plan module and a callable search, ``autopar.explain``
both the package and a function, ``estimate`` agrees with the cost model, ``apply_plan`` needs (and
uses) a process group."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import autopar
from autopar.errors import AutoparError

GPT_SMALL = "examples/gpt_small.py"


@pytest.fixture(scope="module")
def small_plan(repo):
    return autopar.plan(str(repo / GPT_SMALL), gpus=4, gpus_per_node=4, global_batch=8, micro_batch=(1, 2))


def test_plan_module_and_function_coexist() -> None:
    plan_module = importlib.import_module("autopar.plan")
    from autopar.plan import Plan, load_plan  # noqa: F401 - the import itself is the test

    assert autopar.plan is sys.modules["autopar.plan"] is plan_module
    assert callable(autopar.plan) and autopar.plan.Plan is Plan is autopar.Plan
    importlib.import_module("autopar.explain.trace")  # importing a submodule must not hide the function

    assert callable(autopar.explain) and autopar.explain is sys.modules["autopar.explain"]


def test_fresh_interpreter_sees_callables_without_heavy_imports(repo) -> None:
    code = ("import sys, autopar; from autopar.plan import Plan; import autopar.commands.main; "
            "assert callable(autopar.plan) and callable(autopar.explain); print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"  # import autopar stays light


def test_plan_searches_and_returns_a_predicted_plan(small_plan, repo) -> None:
    assert isinstance(small_plan, autopar.Plan)
    assert small_plan.parallel.world_size == 4 and small_plan.cluster.gpus_per_node == 4
    assert small_plan.training.global_batch_size == 8 and small_plan.model.num_blocks == 8
    est = autopar.estimate(str(repo / GPT_SMALL), small_plan, cluster="a100-80g")
    assert est.step_time_s == pytest.approx(small_plan.prediction["step_time_s"], rel=1e-9)


def test_plan_knobs_restrict_the_search(repo) -> None:
    p = autopar.plan(str(repo / GPT_SMALL), gpus=2, gpus_per_node=2, global_batch=4, micro_batch=1,
                     recompute_modes=["full"], zero_stages=(3,))
    assert p.parallel.recompute == "full"
    assert p.parallel.zero == 3 or p.parallel.dp * p.parallel.cp == 1
    with pytest.raises(AutoparError, match="unknown search knob 'tp'"):
        autopar.plan(str(repo / GPT_SMALL), gpus=2, tp=2)


def test_in_memory_modules_are_refused_with_a_reason() -> None:
    import torch

    with pytest.raises(AutoparError, match="path to a model file"):
        autopar.plan(torch.nn.Linear(2, 2), gpus=2)


def test_estimate_and_explain_accept_a_plan_path(tmp_path, small_plan, repo) -> None:
    path = tmp_path / "p.yaml"
    autopar.save_plan(small_plan, path)
    est = autopar.estimate(str(repo / GPT_SMALL), path)
    assert est.step_time_s == pytest.approx(small_plan.prediction["step_time_s"], rel=1e-9)
    text = autopar.explain(path, model=str(repo / GPT_SMALL))
    assert "== mesh" in text and "memory per GPU" in text
    assert autopar.explain(small_plan, str(repo / GPT_SMALL)) == text
    trace = autopar.trace(small_plan, str(repo / GPT_SMALL))
    assert sum(e["cat"] == "forward" for e in trace["traceEvents"] if e["ph"] == "X") == small_plan.num_microbatches


def test_apply_plan_outside_a_process_group_is_a_one_line_error(small_plan, repo) -> None:
    with pytest.raises(AutoparError, match="initialised process group"):
        autopar.apply_plan(str(repo / GPT_SMALL), small_plan)


@pytest.mark.dist
def test_apply_plan_in_a_world_of_one(repo, make_plan, tmp_path) -> None:
    import socket

    import torch
    import torch.distributed as dist

    from autopar.executor.parallel.host_reference import build_reference
    from autopar.modelfile import load_model_file

    model = repo / "tests" / "dist" / "models" / "tiny_gpt.py"
    plan = make_plan(4, global_batch_size=2, seq_len=32, dtype="fp32")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        exe = autopar.apply_plan(str(model), plan, seed=7)
        ref = dict(build_reference(load_model_file(model), 7).named_parameters())
        got = exe.named_parameters()
        assert set(got) == set(ref)
        for name, p in got.items():
            assert torch.equal(p.detach().cpu(), ref[name].detach()), name
        assert exe.optimizer is not None
    finally:
        dist.destroy_process_group()
