"""``autopar explain`` (tables, --trace), ``autopar launch`` (torchrun lines, sbatch, world-size check)
and ``autopar profiles`` (shipped and local profiles), run as subprocesses."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml


def _write_plan(path: Path, repo: Path, *, dp: int, tp: int, pp: int, gpus_per_node: int = 8,
                global_batch: int = 8, **parallel) -> Path:
    data = {
        "version": 1,
        "model": {"file": str(repo / "examples" / "gpt_small.py"), "num_blocks": 8},
        "cluster": {"profile": "a100-80g", "num_gpus": dp * tp * pp, "gpus_per_node": gpus_per_node},
        "training": {"global_batch_size": global_batch, "micro_batch_size": 1, "seq_len": 128},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, **parallel},
    }
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def explained(run_cli, repo, tmp_path_factory):
    d = tmp_path_factory.mktemp("explain")
    plan = _write_plan(d / "plan.yaml", repo, dp=2, tp=2, pp=2, recompute="full")
    res = run_cli("explain", plan, "--trace", d / "trace.json")
    return res, d / "trace.json"


def test_explain_prints_groups_stages_memory_and_comm(explained) -> None:
    res, _ = explained
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "dp=2 tp=2 pp=2 cp=1" in out
    assert "tp groups      [0, 1] @ node 0  [2, 3] @ node 0" in out
    assert "               [4, 5] @ node 0  [6, 7] @ node 0" in out
    assert "dp groups      [0, 2] @ node 0  [1, 3] @ node 0" in out
    assert "pp groups      [0, 4] @ node 0  [1, 5] @ node 0" in out
    stages = out.split("== pipeline stages ==")[1].split("== memory")[0]
    assert re.search(r"^\s*0\s+0\s+0-3\s+4\s+embedding", stages, re.M)
    assert re.search(r"^\s*1\s+1\s+4-7\s+4\s+head\+loss", stages, re.M)
    memory = out.split("== memory")[1].split("peak")[0]
    rows = [line.split() for line in memory.splitlines() if re.match(r"^\d+\s", line)]
    assert [r[0] for r in rows] == ["0", "1"]
    for word in ("TP forward (blocks)", "TP forward again (full recompute)", "DP gradient all-reduce",
                 "PP activations/gradients", "nvlink", "bubble", "MFU", "of it recompute"):
        assert word in out, word


def test_explain_trace_file(explained) -> None:
    res, path = explained
    data = json.loads(path.read_text(encoding="utf-8"))
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1}
    counts = Counter((e["tid"], e["cat"]) for e in spans)
    m = 4  # global batch 8 / (dp 2 x micro-batch 1)
    assert counts[(0, "forward")] == counts[(1, "forward")] == m
    assert counts[(0, "backward")] == counts[(1, "backward")] == m
    assert counts[(0, "recompute")] == m
    assert "predicted timeline" in res.stdout and str(path) in res.stdout


def test_explain_missing_plan_is_one_line(run_cli, tmp_path) -> None:
    res = run_cli("explain", tmp_path / "nope.yaml")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "does not exist" in res.stderr


@pytest.fixture(scope="module")
def plan16(repo, tmp_path_factory) -> Path:
    return _write_plan(tmp_path_factory.mktemp("launch") / "plan16.yaml", repo, dp=4, tp=2, pp=2, global_batch=16)


def test_launch_prints_one_torchrun_line_per_node(run_cli, plan16) -> None:
    res = run_cli("launch", plan16, "--nnodes", "2", "--master-addr", "node0", "--master-port", "12345")
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("torchrun")]
    assert len(lines) == 2
    for i, line in enumerate(lines):
        assert line == (f"torchrun --nnodes 2 --nproc-per-node 8 --node-rank {i} --master-addr node0 "
                        f"--master-port 12345 -m autopar run {plan16}")
    assert "# node 1 (global ranks 8-15)" in res.stdout


def test_launch_slurm_script(run_cli, plan16) -> None:
    res = run_cli("launch", plan16, "--nnodes", "2", "--slurm", "--model", "examples/gpt_small.py", "--steps", "5")
    assert res.returncode == 0, res.stderr
    s = res.stdout
    assert s.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "export MASTER_PORT=29500"):
        assert line in s.splitlines(), line
    assert "scontrol show hostnames" in s
    srun = next(line for line in s.splitlines() if line.startswith("srun "))
    assert srun.startswith("srun torchrun --nnodes 2 --nproc-per-node 8 ")
    assert '--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' in srun
    assert srun.endswith(f"-m autopar run {plan16} examples/gpt_small.py --steps 5")


def test_launch_wrong_world_size_is_one_line(run_cli, plan16) -> None:
    res = run_cli("launch", plan16, "--nnodes", "3", "--master-addr", "node0")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1
    assert "needs 16 GPUs" in res.stderr and "3 node(s) x 8" in res.stderr and "--nnodes 2" in res.stderr


def test_launch_needs_master_addr_without_slurm(run_cli, plan16) -> None:
    res = run_cli("launch", plan16, "--nnodes", "2")
    assert res.returncode == 2 and "--master-addr" in res.stderr and res.stdout == ""


def test_profiles_lists_local_profiles_with_key_figures(run_cli, repo, tmp_path) -> None:
    local = tmp_path / "profiles"
    local.mkdir()
    data = yaml.safe_load((repo / "profiles" / "h100-80g.yaml").read_text(encoding="utf-8"))
    data["name"] = "my-lab"
    data["gpu"]["name"] = "LabGPU"
    data["network"]["gpus_per_node"] = 4
    (local / "my-lab.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    shutil.copy(repo / "profiles" / "a100-80g.yaml", local / "a100-80g.yaml")  # a local copy overrides
    res = run_cli("profiles", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line for line in res.stdout.splitlines()[2:] if line.strip()}
    assert {"a100-80g", "h100-80g", "h200-141g", "my-lab"} <= set(rows)
    assert "LabGPU" in rows["my-lab"] and str(local / "my-lab.yaml") in rows["my-lab"]
    assert re.search(r"\s4\s", rows["my-lab"])  # GPUs per node
    assert str(local / "a100-80g.yaml") in rows["a100-80g"]
    assert str(repo / "profiles" / "h200-141g.yaml") in rows["h200-141g"]


@pytest.mark.parametrize("cmd,words", [
    ("explain", ["PLAN.yaml", "MODEL.py", "--cluster", "--trace"]),
    ("launch", ["--nnodes", "--master-addr", "--master-port", "--slurm", "--model"]),
])
def test_help(run_cli, cmd, words) -> None:
    res = run_cli(cmd, "--help")
    assert res.returncode == 0
    for w in words:
        assert w in res.stdout, w
