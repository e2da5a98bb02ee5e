"""A stopped ``autopar plan`` leaves nothing behind: SIGTERM gives exit 143 and one line, and its
forked CP-SAT child dies with it -- by SIGTERM or by SIGKILL, which no handler of the parent sees
(the child asks the kernel for a parent-death signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the forked solver child exists on Linux only")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_plan(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("AUTOPAR_CP_SAT_PROCESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "autopar", "plan", "examples/gpt.py", "--gpus", "1024,2048,4096",
                             "-o", str(tmp_path / "plans"), "--no-cache"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        kids = _children(proc.pid)
        if kids:
            return proc, kids
        time.sleep(0.05)
    proc.kill()
    pytest.skip("the plan started no solver child here (one core, or it finished first)")


def _gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_sigterm_is_exit_143_one_line_and_no_orphan(tmp_path: Path) -> None:
    proc, kids = _start_plan(tmp_path)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("searching")]
    assert lines[-1] == "autopar: terminated (SIGTERM)" and "Traceback" not in err, err[-2000:]
    assert _gone(kids), "the solver child outlived its parent"
    assert not list((tmp_path / "plans").glob("*.yaml"))


def test_sigkill_takes_the_solver_child_with_it(tmp_path: Path) -> None:
    proc, kids = _start_plan(tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    assert _gone(kids), "the solver child outlived its parent's SIGKILL"
