"""The contention curve (autopar.profiler.contention): levels timed in turns with paused helpers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopar.profiler.contention import _pause_beyond, measure_contention

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "examples" / "zoo" / "odd_names_decoder.py"

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP (POSIX)")


def _state(pid: int) -> str:
    # /proc/PID/stat: "pid (comm) S ..."; T = stopped
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_pause_beyond_stops_the_helpers_past_the_level_and_resumes_them() -> None:
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc")
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        _pause_beyond(procs, 1)
        time.sleep(0.2)
        assert [_state(p.pid) == "T" for p in procs] == [False, True, True]
        _pause_beyond(procs, 3)
        time.sleep(0.2)
        assert not any(_state(p.pid) == "T" for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_the_curve_times_every_level_and_leaves_no_helper_behind() -> None:
    from autopar.modelfile import load_model_file

    before = _children()
    # two levels (one helper process): the turns, the pause and the stop are the same code at any count
    curve = measure_contention(load_model_file(ZOO), 1, (2, 1), repeats=3)
    assert [r for r, _ in curve] == [1, 2] and all(t > 0 for _, t in curve)
    assert _children() <= before  # the helpers, paused or not, were all stopped


def _children() -> set[int]:
    import os

    me = str(os.getpid())
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            out.add(int(stat.parent.name))
    return out
