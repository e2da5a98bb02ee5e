"""Issue 4: user errors are one-line AutoparErrors found before any collective (no hang), and the
``autopar run`` entry point works end to end through its torchrun re-launch."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import MODELS, Case

from autopar.commands.run import add_arguments
from autopar.commands.run import main as run_main
from autopar.errors import AutoparError
from autopar.executor.runtime.checks import preflight
from autopar.modelfile import load_model_file
from autopar.plan import plan_from_dict, save_plan

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _save(case: Case, tmp_path: Path, **model_overrides) -> Path:
    d = case.plan_dict()
    d["model"].update(model_overrides)
    path = tmp_path / f"{case.name}.yaml"
    save_plan(plan_from_dict(d), path)
    return path


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_wrong_world_size_is_refused_before_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autopar.launch.local as local

    def no_launch(*args: object, **kwargs: object) -> int:
        raise AssertionError("ranks were launched for a plan of the wrong world size")

    monkeypatch.setattr(local, "run_local", no_launch)
    plan = _save(Case(name="dp4", model="gpt", parallel={"dp": 4}), tmp_path)
    with pytest.raises(AutoparError) as exc:
        run_main(_args(str(plan), "--nproc-per-node", "2"))
    assert "needs 4 processes" in _one_line(exc) and "--nproc-per-node 4" in str(exc.value)


def test_wrong_world_size_under_torchrun_fails_before_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    plan = _save(Case(name="dp2", model="gpt", parallel={"dp": 2}), tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    for var, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("TORCHELASTIC_USE_AGENT_STORE", "True")):
        monkeypatch.setenv(var, value)  # as torchrun sets them
    with pytest.raises(AutoparError, match=r"needs 2 processes .* but 3 were started"):
        run_main(_args(str(plan)))
    assert not dist.is_initialized()


def test_plan_for_another_model_block_count(tmp_path: Path) -> None:
    plan = _save(Case(name="gpt", model="gpt", parallel={"dp": 2}), tmp_path)
    with pytest.raises(AutoparError) as exc:
        run_main(_args(str(plan), str(MODELS["mlp"]), "--nproc-per-node", "2"))
    assert "4 blocks" in _one_line(exc) and "12" in str(exc.value)


def test_sha256_mismatch_warns_but_runs_preflight() -> None:
    d = Case(name="sha", model="gpt", parallel={"dp": 2}).plan_dict()
    d["model"]["sha256"] = "0" * 64
    spec, warnings = preflight(plan_from_dict(d), load_model_file(MODELS["gpt"]), 2)
    assert spec.num_blocks == 4
    assert len(warnings) == 1 and "sha256" in warnings[0]


@pytest.mark.parametrize(
    ("model", "parallel", "needle"),
    [
        ("gpt", {"tp": 3}, "does not divide the model's 4 attention heads"),
        ("llama", {"tp": 4}, "does not divide the model's 2 key/value heads"),
        ("gpt", {"tp": 2, "cp": 4, "cp_kind": "ulysses"}, "Ulysses"),
        # the MLP's fc1 -> fc2 pairs are inferred (autopar.spec.tp_infer): tp must divide their width
        ("mlp", {"tp": 3}, "does not divide the width"),
        ("mlp", {"cp": 2}, "not a sequence model"),
        ("mlp", {"dp": 2, "recompute": "selective"}, "selective recompute"),
    ],
)
def test_impossible_parallelism_is_one_line_error(model: str, parallel: dict, needle: str) -> None:
    d = Case(name="bad", model=model, parallel=parallel, global_batch_size=8).plan_dict()
    if model == "mlp":
        d["training"]["seq_len"] = 8  # the mlp has no sequence; let the plan itself pass
    plan = plan_from_dict(d)
    with pytest.raises(AutoparError) as exc:
        preflight(plan, load_model_file(MODELS[model]), plan.parallel.world_size)
    assert needle in _one_line(exc)


def test_torchrun_with_wrong_world_size_exits_without_hang(tmp_path: Path) -> None:
    plan = _save(Case(name="dp4", model="gpt", parallel={"dp": 4}), tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "autopar", "run", str(plan)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "autopar: error: the plan needs 4 processes" in proc.stderr


def test_run_cli_relaunches_and_matches_reference(tmp_path: Path) -> None:
    """`autopar run PLAN --nproc-per-node 2` trains, reports, and equals the single-process run."""
    import torch

    from autopar.executor.runtime.train import run_reference

    case = Case(name="cli-zero3", model="gpt", parallel={"dp": 2, "zero": 3})
    d = case.plan_dict()
    d["prediction"] = {"step_time_s": 1.0, "peak_memory_bytes": 1e8}
    path = tmp_path / "plan.yaml"
    path.write_text(json.dumps(d))  # JSON is YAML
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "autopar", "run", str(path), "--nproc-per-node", "2",
           "--steps", "2", "--seed", "7", "--report", str(report)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "measured vs predicted" in proc.stdout
    got = json.loads(report.read_text())
    assert got["world_size"] == 2 and got["predicted"]["step_time_s"] == 1.0
    assert set(got["error_pct"]) == {"step_time_s", "peak_memory_bytes"}
    assert got["measured"]["peak_memory_bytes"] > 0 and got["measured"]["tokens_per_s"] > 0
    torch.set_num_threads(2)
    ref, _ = run_reference(load_model_file(MODELS["gpt"]), case.plan(), steps=2, seed=7, lr=1e-3)
    assert got["losses"] == pytest.approx(ref, rel=1e-4)


RANK_DEPENDENT_MODEL = '''
import os
import torch
from torch import nn

WIDTH = 16 + 8 * int(os.environ.get("RANK", "0"))  # a model file that reads its rank: a different width on each


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, 8)
'''


def test_ranks_that_build_different_models_are_named_in_one_line(tmp_path: Path) -> None:
    model = tmp_path / "rank_model.py"
    model.write_text(RANK_DEPENDENT_MODEL)
    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({
        "version": 1, "model": {"file": str(model), "num_blocks": 2},
        "cluster": {"profile": "cpu-local-2", "num_gpus": 2, "gpus_per_node": 2},
        "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 1, "dtype": "fp32"},
        "parallel": {"dp": 2, "tp": 1, "pp": 1}}))
    cmd = [sys.executable, "-m", "autopar", "run", str(plan), "--nproc-per-node", "2", "--steps", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("autopar: error:")]
    assert errors and "the ranks built different models -- rank 0 " in errors[-1], proc.stderr[-3000:]
    assert "rank 1 " in errors[-1] and "Traceback" not in proc.stderr
