"""Probe autopar's failure contract end to end and print a table.

    python benchmarks/fault_probe.py [--only NAME[,NAME]] [--nproc 2]

Every probe runs ``autopar run PLAN --nproc-per-node N`` as a user would (the tiny GPT of the
distributed tests, gloo on CPU) and records the exit code, the number of ``autopar: error:`` lines,
whether a traceback was printed, and the seconds from the fault (the test hook's line, or the
signal) to the exit; for the checkpoint probes, the seconds of the whole resumed run. The contract:
a killed rank exits 4 with one line within 10 s, a stopped rank
under ``--timeout 10`` within 20 s; a damaged checkpoint falls back with one warning; a crafted
one never runs code; SIGTERM stops every rank; no socket listens beyond loopback.
Timings are only meaningful on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "dist"))
sys.path.insert(0, str(ROOT))

from test_fault_cli import damage_bytes, descendants, is_loopback, listening, start  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Result:
    name: str
    expect: str
    code: int
    error_lines: int
    traceback: bool
    fault_to_exit_s: float | None
    ok: bool
    note: str


def _summary(name: str, expect: str, job, code: int, ended: float, event: float | None, ok: bool, note: str = "") -> Result:
    return Result(name=name, expect=expect, code=code, error_lines=len(job.error_lines()),
                  traceback="Traceback" in job.stderr(), fault_to_exit_s=None if event is None else ended - event,
                  ok=ok and "Traceback" not in job.stderr(), note=note or (job.error_lines() or [""])[0][:90])


def _checkpoints(tmp: Path, nproc: int, steps: int = 3) -> Path:
    ck = tmp / "ck"
    job = start(tmp, "--steps", steps, "--checkpoint-dir", ck, "--checkpoint-every", 1, "--keep-checkpoints", steps,
                nproc=nproc)
    code, _ = job.wait(timeout=600)
    if code != 0:
        raise SystemExit(f"could not make the checkpoints: {job.stderr()[-2000:]}")
    return ck


def probe_kill(tmp: Path, nproc: int) -> Result:
    job = start(tmp, "--steps", 6, "--timeout", 60, env={"AUTOPAR_TEST_KILL_AT_STEP": "2", "AUTOPAR_TEST_KILL_RANK": "1"},
                nproc=nproc)
    code, ended = job.wait(timeout=600)
    event = job.first("err", "kills itself")
    ok = code == 4 and len(job.error_lines()) == 1 and event is not None and ended - event < 10
    return _summary("killed rank", "4, 1 line, < 10 s", job, code, ended, event, ok)


def probe_kill_in_save(tmp: Path, nproc: int) -> Result:
    job = start(tmp, "--steps", 4, "--checkpoint-dir", tmp / "ck", "--checkpoint-every", 2,
                env={"AUTOPAR_TEST_KILL_IN_SAVE": "1"}, nproc=nproc)
    code, ended = job.wait(timeout=600)
    event = job.first("err", "kills itself in a checkpoint save")
    from autopar.executor.checkpoint.integrity import damage

    latest = tmp / "ck" / "latest"  # absent, or naming an intact checkpoint (the shards may all have been written)
    intact = not latest.exists() or damage(tmp / "ck" / latest.read_text().strip()) is None
    ok = code == 4 and len(job.error_lines()) == 1 and intact and event is not None and ended - event < 10
    return _summary("rank killed in a checkpoint save", "4, 1 line, latest intact", job, code, ended, event, ok)


def probe_stop(tmp: Path, nproc: int) -> Result:
    job = start(tmp, "--steps", 6, "--timeout", 10, env={"AUTOPAR_TEST_STOP_AT_STEP": "2", "AUTOPAR_TEST_STOP_RANK": "1"},
                nproc=nproc)
    code, ended = job.wait(timeout=600)
    event = job.first("err", "stops itself")
    ok = code == 4 and len(job.error_lines()) == 1 and event is not None and ended - event < 20
    return _summary("stopped rank, --timeout 10", "4, 1 line, < 20 s", job, code, ended, event, ok)


def probe_restart(tmp: Path, nproc: int) -> Result:
    job = start(tmp, "--steps", 4, "--checkpoint-dir", tmp / "ck", "--checkpoint-every", 1, "--max-restarts", 1,
                env={"AUTOPAR_TEST_KILL_AT_STEP": "2", "AUTOPAR_TEST_KILL_RANK": "1"}, nproc=nproc)
    code, ended = job.wait(timeout=600)
    ok = code == 0 and job.first("out", "resumed from") is not None
    return _summary("killed rank, --max-restarts 1", "0, resumed", job, code, ended, None, ok,
                    note="resumed" if ok else "")


def _damaged(label: str, hurt: Callable[[Path], None], expect_code: int = 0) -> Callable[[Path, int], Result]:
    def probe(tmp: Path, nproc: int) -> Result:
        ck = _checkpoints(tmp, nproc)
        hurt(ck / "step-3")
        t0 = time.monotonic()
        job = start(tmp, "--steps", 4, "--checkpoint-dir", ck, "--resume", nproc=nproc)
        code, ended = job.wait(timeout=600)
        warnings = [l for _, l in job.err if l.startswith("autopar: warning:")]
        if expect_code == 0:
            ok = code == 0 and len(warnings) == 1 and job.first("out", "step-2 (--resume)") is not None
            note = warnings[0][17:107] if warnings else ""
        else:
            ok = code == expect_code and len(job.error_lines()) == 1
            note = ""
        res = _summary(label, "0, 1 warning, from step-2" if expect_code == 0 else f"{expect_code}, 1 line",
                       job, code, ended, t0, ok, note)
        return res
    return probe


def _shard(step: Path) -> Path:
    return sorted(step.glob("*.distcp"))[-1]


def _wider(step: Path) -> None:
    """Replace step-3 by a checkpoint of a same-depth GPT of another width (records intact)."""
    tmp = step.parent.parent / "wide"
    tmp.mkdir()
    model = tmp / "wide.py"
    model.write_text((ROOT / "tests" / "dist" / "models" / "tiny_gpt.py").read_text().replace("hidden_size=64",
                                                                                            "hidden_size=32"))
    plan = json.loads((step.parent.parent / "plan.yaml").read_text())
    plan["model"]["file"] = str(model)
    (tmp / "plan.yaml").write_text(json.dumps(plan))
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "autopar", "run", str(tmp / "plan.yaml"), "--nproc-per-node",
                    str(plan["parallel"]["dp"]), "--steps", "3", "--checkpoint-dir", str(tmp / "ck")], env=env,
                   capture_output=True, check=True)
    shutil.rmtree(step.parent)
    shutil.copytree(tmp / "ck", step.parent)


def probe_crafted(tmp: Path, nproc: int) -> Result:
    from autopar.executor.checkpoint.integrity import file_record

    ck = _checkpoints(tmp, nproc, steps=1)
    marker = tmp / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    step = ck / "step-1"
    (step / ".metadata").write_bytes(pickle.dumps(Evil()))
    meta = json.loads((step / "meta.json").read_text())
    meta["files"] = file_record(step, exclude=("meta.json",))  # the attacker rewrites the checksums too
    (step / "meta.json").write_text(json.dumps(meta))
    t0 = time.monotonic()
    job = start(tmp, "--steps", 2, "--checkpoint-dir", ck, "--resume", nproc=nproc)
    code, ended = job.wait(timeout=600)
    ok = code == 2 and len(job.error_lines()) == 1 and not marker.exists()
    return _summary("crafted .metadata pickle", "2, 1 line, no code run", job, code, ended, t0, ok)


def probe_nan(tmp: Path, nproc: int) -> Result:
    job = start(tmp, "--steps", 4, "--checkpoint-dir", tmp / "ck", "--checkpoint-every", 1,
                env={"AUTOPAR_TEST_NAN_AT_STEP": "2"}, nproc=nproc)
    code, ended = job.wait(timeout=600)
    latest = (tmp / "ck" / "latest").read_text().strip() if (tmp / "ck" / "latest").exists() else None
    ok = code == 2 and len(job.error_lines()) == 1 and latest == "step-1"
    return _summary("NaN loss at step 2", "2, 1 line, latest step-1", job, code, ended, None, ok)


def probe_shared_dir(tmp: Path, nproc: int) -> Result:
    first = start(tmp, "--steps", 10_000, "--checkpoint-dir", tmp / "ck", "--checkpoint-every", 50, nproc=nproc)
    first.wait_for("out", "step 1/", timeout=600)
    job = start(tmp, "--steps", 2, "--checkpoint-dir", tmp / "ck", nproc=nproc)
    code, ended = job.wait(timeout=600)
    first.proc.send_signal(signal.SIGTERM)
    first.wait(timeout=120)
    ok = code == 2 and len(job.error_lines()) == 1 and "in use" in job.error_lines()[0]
    return _summary("second run on the same --checkpoint-dir", "2, 1 line", job, code, ended, None, ok)


def probe_sigterm(tmp: Path, nproc: int) -> Result:
    job = start(tmp, "--steps", 10_000, "--checkpoint-dir", tmp / "ck", "--checkpoint-every", 5, nproc=nproc)
    job.wait_for("out", "step 2/", timeout=600)
    family = [job.proc.pid, *descendants(job.proc.pid)]
    socks = listening(family)
    wide = [s for s in socks if not is_loopback(s[0])]
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    code, ended = job.wait(timeout=120)
    time.sleep(0.3)
    alive = [p for p in family[1:] if Path(f"/proc/{p}").exists()]
    ok = code == 143 and len(job.error_lines()) == 1 and not alive and socks and not wide
    return _summary("SIGTERM to autopar run", "143, all ranks gone, loopback only", job, code, ended, t0, ok,
                    note=f"{len(socks)} listening sockets, {len(wide)} beyond loopback, {len(alive)} ranks left")


PROBES: dict[str, Callable[[Path, int], Result]] = {
    "kill": probe_kill,
    "kill-in-save": probe_kill_in_save,
    "stop": probe_stop,
    "restart": probe_restart,
    "flipped-bytes": _damaged("4 KiB of flipped bytes in a shard", lambda s: damage_bytes(_shard(s))),
    "half-shard": _damaged("a shard cut in half",
                           lambda s: _shard(s).write_bytes(_shard(s).read_bytes()[: _shard(s).stat().st_size // 2])),
    "empty-shard": _damaged("an empty shard", lambda s: _shard(s).write_bytes(b"")),
    "missing-shard": _damaged("a missing shard", lambda s: _shard(s).unlink()),
    "truncated-metadata": _damaged("a truncated .metadata",
                                   lambda s: (s / ".metadata").write_bytes((s / ".metadata").read_bytes()[:100])),
    "deleted-metadata": _damaged("a deleted .metadata", lambda s: (s / ".metadata").unlink()),
    "other-width": _damaged("a same-depth model of another width", _wider, expect_code=2),
    "crafted-pickle": probe_crafted,
    "nan": probe_nan,
    "shared-dir": probe_shared_dir,
    "sigterm": probe_sigterm,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated probe names: " + ", ".join(PROBES))
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(PROBES)
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"fault-{name}-") as tmp:
            r = PROBES[name](Path(tmp), args.nproc)
        rows.append(r)
        t = "-" if r.fault_to_exit_s is None else f"{r.fault_to_exit_s:.1f}"
        print(f"{'ok  ' if r.ok else 'FAIL'} {r.name:40s} exit {r.code:3d}  error lines {r.error_lines}  "
              f"traceback {'yes' if r.traceback else 'no '}  fault->exit {t:>6s} s  expect {r.expect}  | {r.note}",
              flush=True)
    bad = sum(not r.ok for r in rows)
    print(f"\n{len(rows) - bad} of {len(rows)} probes meet the contract")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
