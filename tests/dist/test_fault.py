"""Issue 6 acceptance: a rank that dies restarts the job from the last checkpoint; a hang becomes an
error that names the rank and the collective. Real ``torchrun`` (torch.distributed.run) subprocesses,
2 gloo ranks, the tiny GPT; the uninterrupted run is the single-process reference (which every plan
equals, tests/dist/test_equivalence.py)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import MODELS, Case

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
STEPS, SEED = 4, 11


def _plan(tmp_path: Path) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(json.dumps(Case(name="f", model="gpt", parallel={"dp": 2, "zero": 3}).plan_dict()))
    return path


def _torchrun(tmp_path: Path, *extra: str, restarts: int, env: dict[str, str], timeout: float = 240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", "-m", "autopar", "run", str(_plan(tmp_path)),
           "--steps", str(STEPS), "--seed", str(SEED), *extra]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    return proc, time.perf_counter() - t0


@functools.lru_cache(maxsize=None)
def _reference() -> list[float]:
    import torch

    from autopar.executor.runtime.train import run_reference
    from autopar.modelfile import load_model_file

    torch.set_num_threads(2)
    plan = Case(name="f", model="gpt", parallel={"dp": 2, "zero": 3}).plan()
    losses, _ = run_reference(load_model_file(MODELS["gpt"]), plan, steps=STEPS, seed=SEED, lr=1e-3)
    return losses


def test_killed_rank_restarts_and_resumes_from_last_checkpoint(tmp_path: Path) -> None:
    report, ck, trace = tmp_path / "report.json", tmp_path / "ck", tmp_path / "trace.json"
    proc, _ = _torchrun(tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--report", str(report),
                        "--trace", str(trace), "--trace-steps", "1",
                        restarts=1, env={"AUTOPAR_TEST_KILL_AT_STEP": "2", "AUTOPAR_TEST_KILL_RANK": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rank 1 kills itself before step 3" in proc.stderr  # the fault really happened
    got = json.loads(report.read_text())
    # the second attempt resumed from the checkpoint of step 2 and ran steps 3-4
    assert got["resumed_from"].endswith("step-2") and got["start_step"] == 2
    assert len(got["losses"]) == 2
    ref = _reference()
    assert got["losses"][-1] == pytest.approx(ref[-1], rel=1e-4)
    assert got["loss_history"] == pytest.approx(ref, rel=1e-4)
    assert (ck / "latest").read_text().strip() == f"step-{STEPS}"
    assert not list(ck.glob("*.tmp"))
    # the measured trace of the second attempt: Chrome trace format with one profiled step
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("ProfilerStep") for e in events)
    assert any("gloo" in e.get("name", "") or "all_gather" in e.get("name", "") for e in events)


def test_hang_becomes_error_naming_rank_and_collective(tmp_path: Path) -> None:
    proc, wall = _torchrun(tmp_path, "--timeout", "6", restarts=0,
                           env={"AUTOPAR_TEST_HANG_AT_STEP": "1", "AUTOPAR_TEST_HANG_RANK": "1"}, timeout=180)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith("autopar: error:")]
    assert lines, proc.stderr[-3000:]
    line = lines[0]
    assert "rank 0 in step 2" in line and "did not complete within --timeout 6 s" in line, line
    assert "gloo:" in line and "group" in line, line  # the collective and its group, from the flight recorder
    assert wall < 120  # the 6 s timeout fired, not torch's 30-minute default
