"""Issue 13, the rank-level findings through the CLI as a user calls it: ``autopar run --nproc-per-node 2``.

A killed rank and a stopped rank (exit 4, one line naming the rank, the step and the collective),
a damaged latest checkpoint (fallback with one warning; none intact: one line, exit 2), SIGTERM
(forwarded, every rank gone, exit 143) and the job's listening sockets (loopback only). Time
bounds here are loose (a loaded 2-core CI machine); benchmarks/fault_probe.py measures them and
imports the helpers below.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "dist" / "models" / "tiny_gpt.py"
pytestmark = pytest.mark.dist


def write_plan(tmp: Path, dp: int = 2) -> Path:
    plan = {
        "version": 1,
        "model": {"file": str(TINY), "num_blocks": 4},
        "cluster": {"profile": "a100-80g", "num_gpus": dp, "gpus_per_node": 8},
        "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 32, "dtype": "fp32", "optimizer": "adamw"},
        "parallel": {"dp": dp, "tp": 1, "pp": 1},
    }
    path = tmp / "plan.yaml"
    path.write_text(json.dumps(plan))
    return path


@dataclass
class Job:
    """A running ``autopar run``: its stdout/stderr lines with arrival times."""

    proc: subprocess.Popen
    started: float
    out: list[tuple[float, str]] = field(default_factory=list)
    err: list[tuple[float, str]] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def wait(self, timeout: float) -> tuple[int, float]:
        code = self.proc.wait(timeout=timeout)
        ended = time.monotonic()
        for r in self.readers:
            r.join(timeout=10)
        return code, ended

    def first(self, stream: str, text: str) -> float | None:
        return next((t for t, line in getattr(self, stream) if text in line), None)

    def error_lines(self) -> list[str]:
        return [line for _, line in self.err if line.startswith("autopar: error:")]

    def stderr(self) -> str:
        return "\n".join(line for _, line in self.err)

    def wait_for(self, stream: str, text: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.first(stream, text)
            if t is not None:
                return t
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{text!r} never appeared on {stream}: {self.stderr()[-3000:]}")


def start(tmp: Path, *args: object, env: dict[str, str] | None = None, nproc: int = 2) -> Job:
    full = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "autopar", "run", str(write_plan(tmp, nproc)), "--nproc-per-node", str(nproc),
           *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=tmp, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job = Job(proc=proc, started=time.monotonic())
    for stream, sink in ((proc.stdout, job.out), (proc.stderr, job.err)):
        def pump(s=stream, k=sink) -> None:
            for line in s:
                k.append((time.monotonic(), line.rstrip("\n")))
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        job.readers.append(t)
    return job


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """(local address, port) of every TCP socket in LISTEN state held by ``pids`` (from /proc)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:
                continue
            addr_hex, port_hex = cols[1].split(":")
            out.append((_addr(addr_hex, v6), int(port_hex, 16)))
    return out


def _addr(hex_addr: str, v6: bool) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    if not v6:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def is_loopback(addr: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def damage_bytes(path: Path, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, min(len(data), mid + n)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------- tests

def _one_fault_line(job: Job, code: int) -> str:
    assert code == 4, job.stderr()[-3000:]
    assert "Traceback" not in job.stderr(), job.stderr()[-3000:]
    lines = job.error_lines()
    assert len(lines) == 1, lines
    return lines[0]


def test_killed_rank_is_one_line_exit_4(tmp_path: Path) -> None:
    job = start(tmp_path, "--steps", 4, "--timeout", 60,
                env={"AUTOPAR_TEST_KILL_AT_STEP": "1", "AUTOPAR_TEST_KILL_RANK": "1"})
    code, ended = job.wait(timeout=400)
    line = _one_fault_line(job, code)
    assert "rank 1 died (SIGKILL) in step 2" in line, line
    assert "rank 0 in step 2: collective gloo:" in line, line  # the survivor's collective, from the flight recorder
    event = job.first("err", "test hook: rank 1 kills itself")
    assert event is not None and ended - event < 60  # detection is a peer-loss, not the 60 s timeout


@pytest.mark.parametrize("nproc", [1, 2])
def test_out_of_device_memory_is_one_line_exit_3(tmp_path: Path, nproc: int) -> None:
    """A rank that runs out of device memory (torch's OutOfMemoryError, raised by a test hook in
    step 2): one line naming the rank and the step and what to do, exit 3, no traceback."""
    job = start(tmp_path, "--steps", 3, "--timeout", 60, nproc=nproc,
                env={"AUTOPAR_TEST_OOM_AT_STEP": "1", "AUTOPAR_TEST_OOM_RANK": str(nproc - 1)})
    code, _ = job.wait(timeout=400)
    assert code == 3, job.stderr()[-3000:]
    assert "Traceback" not in job.stderr(), job.stderr()[-3000:]
    lines = job.error_lines()
    assert len(lines) == 1, lines
    assert f"rank {nproc - 1} ran out of device memory in step 2" in lines[0] and "autopar rehearse" in lines[0]


def test_stopped_rank_times_out_exit_4(tmp_path: Path) -> None:
    # --timeout 6, which the test waits out once: tests/dist/test_fault.py's hang takes the same
    job = start(tmp_path, "--steps", 4, "--timeout", 6,
                env={"AUTOPAR_TEST_STOP_AT_STEP": "1", "AUTOPAR_TEST_STOP_RANK": "1"})
    code, ended = job.wait(timeout=400)
    line = _one_fault_line(job, code)
    assert "rank 0 in step 2" in line and "did not complete within --timeout 6 s" in line, line
    assert "rank 1 was still running" in line, line
    event = job.first("err", "test hook: rank 1 stops itself")
    assert event is not None and ended - event < 90


def test_damaged_latest_checkpoint_falls_back_then_fails_when_none_is_intact(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    job = start(tmp_path, "--steps", 3, "--checkpoint-dir", ck, "--checkpoint-every", 1, "--keep-checkpoints", 3)
    code, _ = job.wait(timeout=400)
    assert code == 0, job.stderr()[-3000:]
    damage_bytes(ck / "step-3" / "__1_0.distcp")  # silent corruption: same size, other bytes
    job = start(tmp_path, "--steps", 4, "--checkpoint-dir", ck, "--resume")
    code, _ = job.wait(timeout=400)
    assert code == 0 and "Traceback" not in job.stderr(), job.stderr()[-3000:]
    warnings = [l for _, l in job.err if l.startswith("autopar: warning:")]
    assert len(warnings) == 1 and "step-3 is damaged" in warnings[0] and "checksum" in warnings[0], warnings
    assert job.first("out", "resumed from") and job.first("out", "step-2 (--resume): 2 steps done"), job.out
    for step in ck.glob("step-*"):
        (step / ".metadata").write_bytes((step / ".metadata").read_bytes()[:100])  # truncated everywhere
    job = start(tmp_path, "--steps", 6, "--checkpoint-dir", ck, "--resume")
    code, _ = job.wait(timeout=400)
    assert code == 2 and "Traceback" not in job.stderr(), job.stderr()[-3000:]
    lines = job.error_lines()
    assert len(lines) == 1 and "no intact checkpoint" in lines[0], lines
    assert [l for _, l in job.err if l.startswith("autopar: warning:")]  # each damaged one was named


def test_sigterm_stops_every_rank_and_nothing_listens_beyond_loopback(tmp_path: Path) -> None:
    job = start(tmp_path, "--steps", 10_000, "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 5)
    job.wait_for("out", "step 2/", timeout=400)
    family = [job.proc.pid, *descendants(job.proc.pid)]
    assert len(family) >= 3  # the launcher and two ranks
    socks = listening(family)
    assert socks, "the job holds no listening socket at all: the check would be vacuous"
    assert all(is_loopback(a) for a, _ in socks), socks
    job.proc.send_signal(signal.SIGTERM)
    code, _ = job.wait(timeout=120)
    assert code == 128 + signal.SIGTERM, job.stderr()[-3000:]
    assert "Traceback" not in job.stderr()
    lines = job.error_lines()
    assert len(lines) == 1 and "interrupted by SIGTERM" in lines[0], lines
    time.sleep(0.5)
    alive = [p for p in family[1:] if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
    assert not alive, alive
    latest = (tmp_path / "ck" / "latest")
    assert not latest.exists() or latest.read_text().startswith("step-")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
