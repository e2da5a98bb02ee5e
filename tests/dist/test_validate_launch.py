"""`autopar validate` and `autopar profile --comm` start their ranks with autopar's own launcher
(launch/local.py); the default plan of a CPU profile validates in under a minute, with progress."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from autopar.commands.validate import MAX_AUTO_STEPS, MIN_AUTO_STEPS, auto_steps

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "examples" / "zoo" / "odd_names_decoder.py"


def _cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "autopar", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_the_default_cpu_plan_validates_in_under_a_minute_without_nproc(tmp_path) -> None:
    prof = tmp_path / "prof.yaml"
    data = yaml.safe_load((ROOT / "profiles" / "cpu-local-2.yaml").read_text(encoding="utf-8"))
    data["measured"]["device"]["cores"] = 2
    prof.write_text(yaml.safe_dump(data), encoding="utf-8")
    r = _cli("plan", str(ZOO), "--gpus", "2", "--profile", str(prof), "-o", "p.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert plan["training"]["global_batch_size"] == 16 and plan["training"]["dtype"] == "fp32"
    t0 = time.monotonic()
    r = _cli("validate", "p.yaml", "--profile", str(prof), "--report", "r.json", cwd=tmp_path, timeout=180)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert elapsed < 60, f"validate of the default CPU plan took {elapsed:.0f} s"
    assert "starting 2 ranks on this host" in r.stderr
    steps = [x for x in r.stderr.splitlines() if x.startswith("autopar validate: step ")]
    rep = json.loads((tmp_path / "r.json").read_text())
    # the default --steps: about AUTO_STEPS_SECONDS of the predicted step, and the step time is
    # the median of the steps past the warm-up
    assert rep["steps"] == auto_steps(plan["prediction"]["step_time_s"]) and MIN_AUTO_STEPS <= rep["steps"] <= MAX_AUTO_STEPS
    assert len(steps) == rep["steps"] and "left" in steps[1] and "left" not in steps[-1]
    st = rep["step_time_s"]
    assert rep["world_size"] == 2 and st["measured"] > 0 and st["warmup_steps"] >= 1
    assert st["warmup_steps"] + st["timed_steps"] == rep["steps"] and st["rule"] in r.stdout
    assert r.stdout.startswith("validate p.yaml (2 ranks")


@pytest.mark.slow
def test_validate_refuses_a_wrong_nproc_and_profile_comm_runs_on_the_loopback_launcher(tmp_path) -> None:
    r = _cli("plan", str(ZOO), "--gpus", "2", "--profile", str(ROOT / "profiles" / "cpu-local-2.yaml"), "-o", "p.yaml",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = _cli("validate", "p.yaml", "--nproc-per-node", "3", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("autopar: error:") == 1 and "--nproc-per-node 2" in r.stderr
    r = _cli("profile", "--comm", "--nproc-per-node", "2", "--repeats", "1", "-o", "c.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    comm = yaml.safe_load((tmp_path / "c.yaml").read_text())["measured"]["comm"]
    assert comm["ranks"] == 2 and "all_reduce" in comm["collectives"]


@pytest.mark.slow
def test_validate_reports_the_machines_drift_at_the_runs_concurrency(tmp_path) -> None:
    """A CPU profile of the model itself has a contention curve: validate times its reference block
    on every rank after training and prints the error at the machine's speed now."""
    r = _cli("profile", str(ZOO), "--device", "cpu", "--micro-batch", "1,2", "--tp", "1", "--cp", "1",
             "--repeats", "2", "--warmup", "1", "--no-comm", "-o", "prof.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    curve = yaml.safe_load((tmp_path / "prof.yaml").read_text())["measured"]["device"]["contention"]
    r = _cli("plan", str(ZOO), "--gpus", "2", "--global-batch", "8", "--profile", "prof.yaml", "-o", "p.yaml",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _cli("validate", "p.yaml", "--steps", "4", "--report", "r.json", cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    d = rep["machine_drift"]
    # the curve at 2 ranks, read as its running maximum (profile_conditions.slowdown)
    assert d["ranks"] == 2 and d["reference_profiled_s"] == pytest.approx(max(t for r, t in curve if r <= 2))
    assert d["reference_now_s"] > 0 and d["factor"] == pytest.approx(d["reference_now_s"] / d["reference_profiled_s"])
    st = rep["step_time_s"]
    expected = 100 * (st["measured"] - st["predicted"] * d["factor"]) / (st["predicted"] * d["factor"])
    assert d["error_after_drift_pct"] == pytest.approx(expected)
    assert "machine now  reference block" in r.stdout and "at today's speed" in r.stdout
