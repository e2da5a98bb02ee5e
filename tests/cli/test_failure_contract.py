"""Issue 13: the failure contract, through the CLI as a user calls it, one row per reproduced finding.

Every row runs ``python -m autopar ...`` in a process of its own and checks the exit code, the number
of lines on stderr, that no traceback is printed, that nothing is written where nothing should be,
and the row's own fact (a FIFO still a FIFO, stdout still JSON, the marker a crafted pickle would
create absent). Rows that need ranks (a killed or stopped rank, a damaged checkpoint under 2
ranks, SIGTERM, the listening sockets) are in tests/dist/test_fault_cli.py; benchmarks/fault_probe.py
runs the slow ones and prints a table.

A row's process is a child forked off one warm process that imported torch and autopar once
(tests/cli/cli_server.py), with the environment of ``cli``; rows marked ``subprocess`` -- and rows
with an environment or a umask of their own -- run ``python -m autopar`` as a subprocess, so the entry
point stays checked end to end (a hang's hard exit, a model's prints kept off stdout, a NaN stop).
"""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml
from plan_data import REPO

TINY = REPO / "tests" / "dist" / "models" / "tiny_gpt.py"
ONE_RANK = {
    "version": 1,
    "model": {"file": str(TINY), "num_blocks": 4},
    "cluster": {"profile": "a100-80g", "num_gpus": 1, "gpus_per_node": 8},
    "training": {"global_batch_size": 2, "micro_batch_size": 1, "seq_len": 32, "dtype": "fp32", "optimizer": "adamw"},
    "parallel": {"dp": 1, "tp": 1, "pp": 1},
}
MODEL_HEAD = TINY.read_text()
# The hang rows' --timeout (the documented limit of each call into the model file). Each row waits
# it out once, so it is short; the only call under it that must finish is the tiny model file's
# import before the build_model hang (milliseconds: autopar has imported torch by then), so a
# loaded CI machine still tells a hang from a slow call. The bound on the wall time is loose: it
# proves the limit fired, not the 300 s default (benchmarks/fault_probe.py measures the real times).
HANG_TIMEOUT_S = 3


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    full = dict(os.environ, OMP_NUM_THREADS="1", **(extra or {}))
    full.pop("AUTOPAR_PROFILES", None)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return full


def cli(*args: object, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: float = 180,
        umask: int | None = None) -> tuple[subprocess.CompletedProcess, float]:
    full = _env(env)
    pre = (lambda: os.umask(umask)) if umask is not None else None
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "autopar", *map(str, args)], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=pre)
    return proc, time.monotonic() - t0


def model(t: Path, name: str, build: str | None = None, head: str = "", inputs: str | None = None) -> Path:
    """The tiny GPT's model file with ``build_model`` / ``example_inputs`` bodies replaced."""
    text = head + "\n" + MODEL_HEAD
    if build is not None:
        text = text.replace("def build_model():\n    return GPT(CONFIG)", f"def build_model():\n{build}")
    if inputs is not None:
        text = text.replace("def example_inputs(micro_batch_size: int):\n    return example_tokens(CONFIG.seq_len, "
                            "CONFIG.vocab_size, micro_batch_size)", f"def example_inputs(micro_batch_size: int):\n{inputs}")
    path = t / name
    path.write_text(text)
    return path


def plan_file(t: Path, name: str = "plan.yaml", text: str | None = None, **sections) -> Path:
    data = json.loads(json.dumps(ONE_RANK))
    for section, changes in sections.items():
        data.setdefault(section, {}).update(changes)
    path = t / name
    path.write_text(text if text is not None else yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass(frozen=True, kw_only=True)
class Row:
    finding: int
    name: str
    setup: Callable[[Path], tuple]  # -> (args, extra cli kwargs)
    code: int
    stderr_lines: int | None = 1  # lines on stderr (progress and test-hook lines excluded); None: not counted
    says: str = ""  # a substring of the error line
    absent: tuple[str, ...] = ()  # paths (relative to tmp) that must not exist afterwards
    check: Callable[[Path, subprocess.CompletedProcess], None] | None = None
    max_wall_s: float | None = None
    subprocess: bool = False  # run as ``python -m autopar`` in a subprocess, not a forked child
    kwargs: dict = field(default_factory=dict)


def _stderr(proc: subprocess.CompletedProcess) -> list[str]:
    return [l for l in proc.stderr.splitlines()
            if l.strip() and not l.startswith(("searching:", "autopar run:", "autopar: test hook", "\rsearching"))
            and "searching:" not in l]


# ------------------------------------------------------------------------------------------ rows

def _exit0(t):
    return ("plan", model(t, "m.py", "    import sys\n    sys.exit(0)\n"), "--gpus", 2, "-o", t / "out.yaml"), {}


def _exit3(t):
    return ("plan", model(t, "m.py", "    raise SystemExit(3)\n"), "--gpus", 2, "-o", t / "out.yaml"), {}


def _base_exc(t):
    m = model(t, "m.py", "    raise Boom('no')\n", head="class Boom(BaseException):\n    pass\n")
    return ("estimate", m, plan_file(t)), {}


def _hang_import(t):
    return ("plan", model(t, "m.py", head="import time\ntime.sleep(600)\n"), "--gpus", 2, "-o", t / "out.yaml",
            "--timeout", HANG_TIMEOUT_S), {}


def _hang_build(t):
    return ("estimate", model(t, "m.py", "    while True:\n        pass\n"), plan_file(t), "--timeout", HANG_TIMEOUT_S), {}


def _prints(t):
    m = model(t, "m.py", "    print('hello from build_model')\n    return GPT(CONFIG)\n", head="print('hello at import')\n")
    return ("estimate", m, plan_file(t), "--json"), {}


def _json_clean(t, proc):
    assert json.loads(proc.stdout)["step_time_s"] > 0  # stdout is exactly the JSON object
    assert "hello from build_model" in proc.stderr


def _wrong_shape(t):
    m = model(t, "m.py", inputs="    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size + 1)\n")
    return ("plan", m, "--gpus", 2, "-o", t / "out.yaml"), {}


def _run_hang_import(t):
    m = model(t, "m.py", head="import time\ntime.sleep(600)\n")
    return ("run", plan_file(t, model={"file": str(m)}), "--timeout", HANG_TIMEOUT_S), {}


def _report_unwritable(t):
    (t / "afile").write_text("x")
    return ("run", plan_file(t), "--report", t / "afile" / "r.json"), {}


def _ckpt_unwritable(t):
    (t / "afile").write_text("x")
    return ("run", plan_file(t), "--checkpoint-dir", t / "afile" / "ck"), {}


def _bad_prediction(t):
    return ("run", plan_file(t, prediction={"step_time_s": "fast", "tokens_per_s": [1], "peak_memory_bytes": None}),
            "--steps", 1, "--report", t / "r.json"), {}


def _report_ok(t, proc):
    rep = json.loads((t / "r.json").read_text())
    assert rep["predicted"] == {} and len(rep["losses"]) == 1


def _fifo(t):
    os.mkfifo(t / "fifo")
    return ("plan", TINY, "--gpus", 2, "-o", t / "fifo", "--quiet"), {}


def _still_fifo(t, proc):
    assert stat.S_ISFIFO(os.lstat(t / "fifo").st_mode)


def _dir_out(t):
    (t / "d").mkdir()
    return ("plan", TINY, "--gpus", 2, "-o", t / "d", "--quiet"), {}


def _umask(t):
    return ("plan", TINY, "--gpus", 2, "-o", t / "new.yaml", "--quiet"), {"umask": 0o027}


def _mode_640(t, proc):
    assert stat.S_IMODE(os.stat(t / "new.yaml").st_mode) == 0o640


def _dup_key(t):
    return ("estimate", plan_file(t, text="version: 1\nversion: 1\n")), {}


def _big_plan(t):
    return ("estimate", plan_file(t, text="version: 1\n# " + "x" * (5 * 2**20) + "\n")), {}


def _trace_bound(t):
    p = plan_file(t, training={"global_batch_size": 1_000_000, "micro_batch_size": 1})
    return ("explain", p, "--trace", t / "trace.json"), {}


def _lock(t):
    from autopar.executor.checkpoint.checkpoint import lock_directory

    held = lock_directory(t / "ck")  # another run holds the directory
    return ("run", plan_file(t), "--checkpoint-dir", t / "ck"), {"_hold": held}


def _launch_newline(t):
    p = plan_file(t, name="a\nsrun rm -rf x.yaml")
    return ("launch", p, "--nnodes", 1, "--slurm"), {}


def _launch_time(t):
    return ("launch", plan_file(t), "--nnodes", 1, "--slurm", "--time", "1:00\n#SBATCH --x"), {}


def _launch_name(t):
    return ("launch", plan_file(t, name="my plan;$(x).yaml"), "--nnodes", 1, "--gpus-per-node", 1, "--slurm", "--time",
            "1-02:00:00"), {}


def _job_name_safe(t, proc):
    assert "#SBATCH --job-name=autopar-my_plan___x_" in proc.stdout
    assert "#SBATCH --time=1-02:00:00" in proc.stdout


def _nan(t):
    return ("run", plan_file(t), "--steps", 3, "--checkpoint-dir", t / "ck", "--checkpoint-every", 1,
            "--report", t / "r.json"), {"env": {"AUTOPAR_TEST_NAN_AT_STEP": "2"}}


def _kept_step1(t, proc):
    assert (t / "ck" / "latest").read_text().strip() == "step-1"
    assert not (t / "ck" / "step-2").exists()


ROWS = [
    Row(finding=8, name="sys.exit(0) in build_model", setup=_exit0, code=2, says="called exit(0)", absent=("out.yaml",)),
    Row(finding=8, name="SystemExit(3) in build_model", setup=_exit3, code=2, says="called exit(3)", absent=("out.yaml",)),
    Row(finding=8, name="a BaseException subclass", setup=_base_exc, code=2, says="Boom: no"),
    Row(finding=8, name=f"hang at import, plan --timeout {HANG_TIMEOUT_S}", setup=_hang_import, code=2,
        says=f"did not finish within --timeout {HANG_TIMEOUT_S} s",
        absent=("out.yaml",), max_wall_s=150, subprocess=True),
    Row(finding=8, name=f"hang in build_model, estimate --timeout {HANG_TIMEOUT_S}", setup=_hang_build, code=2,
        says=f"build_model() did not finish within --timeout {HANG_TIMEOUT_S} s", max_wall_s=150),
    Row(finding=8, name=f"hang at import, run --timeout {HANG_TIMEOUT_S}", setup=_run_hang_import, code=2,
        says=f"import did not finish within --timeout {HANG_TIMEOUT_S} s", max_wall_s=150),
    Row(finding=8, name="a model that prints, estimate --json", setup=_prints, code=0, stderr_lines=None,
        check=_json_clean, subprocess=True),
    Row(finding=8, name="wrong-shape example_inputs", setup=_wrong_shape, code=2, says="dim 0 must be the micro-batch",
        absent=("out.yaml",)),
    Row(finding=9, name="--report under a regular file", setup=_report_unwritable, code=2, says="--report"),
    Row(finding=9, name="--checkpoint-dir under a regular file", setup=_ckpt_unwritable, code=2,
        says="--checkpoint-dir", absent=("afile/ck",)),
    Row(finding=9, name="non-numeric prediction in the plan", setup=_bad_prediction, code=0, stderr_lines=0,
        check=_report_ok),
    Row(finding=10, name="plan -o FIFO", setup=_fifo, code=2, says="is a FIFO", check=_still_fifo),
    Row(finding=10, name="plan -o directory", setup=_dir_out, code=2, says="is a directory"),
    Row(finding=10, name="plan -o new file under umask 027", setup=_umask, code=0, stderr_lines=0, check=_mode_640),
    Row(finding=11, name="duplicate YAML key", setup=_dup_key, code=2, says="duplicate key 'version'"),
    Row(finding=11, name="5 MiB plan file", setup=_big_plan, code=2, says="at most 4 MiB", max_wall_s=150),
    Row(finding=11, name="explain --trace of 1M micro-batches", setup=_trace_bound, code=2, says="more than 500,000",
        absent=("trace.json",), max_wall_s=150),
    Row(finding=11, name="checkpoint directory in use", setup=_lock, code=2, says="in use by another autopar run",
        absent=("ck/latest",)),
    Row(finding=7, name="launch --slurm: newline in the plan name", setup=_launch_newline, code=2,
        says="control character"),
    Row(finding=7, name="launch --slurm: --time with a newline", setup=_launch_time, code=2, says="not a Slurm time"),
    Row(finding=7, name="launch --slurm: shell characters in the plan name", setup=_launch_name, code=0,
        stderr_lines=0, check=_job_name_safe),
    Row(finding=3, name="NaN loss at step 2 (1 rank)", setup=_nan, code=2, says="the loss of step 2 is nan",
        absent=("r.json", "ck/step-2"), check=_kept_step1),
]


@pytest.fixture(scope="module")
def forked():
    from cli_server import CliServer

    server = CliServer(_env(), REPO)
    yield server
    server.close()


def test_some_rows_run_the_entry_point_itself() -> None:
    assert sum(r.subprocess for r in ROWS) >= 2


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.finding}-{r.name}" for r in ROWS])
def test_failure_contract(row: Row, tmp_path: Path, forked) -> None:
    args, kw = row.setup(tmp_path)
    kw = dict(kw)
    held = kw.pop("_hold", None)  # a lock the test keeps open while the CLI runs
    if row.subprocess or kw:  # kw: an environment or a umask of the row's own
        proc, wall = cli(*args, cwd=tmp_path, **kw)
    else:
        t0 = time.monotonic()
        proc = forked.run(*args, cwd=tmp_path, timeout=180)
        wall = time.monotonic() - t0
    del held
    err = _stderr(proc)
    assert proc.returncode == row.code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if row.stderr_lines is not None:
        assert len(err) == row.stderr_lines, err
    assert not any(l.startswith("autopar: error") for l in err) or row.code != 0, err
    if row.says:
        assert err[0].startswith("autopar: error: ") and row.says in err[0], err
    for rel in row.absent:
        assert not (tmp_path / rel).exists(), rel
    if row.check is not None:
        row.check(tmp_path, proc)
    if row.max_wall_s is not None:
        assert wall < row.max_wall_s


def test_crafted_checkpoint_never_runs_code(tmp_path: Path) -> None:
    """Finding 4: a .metadata pickle that would create a file, with meta.json's checksums rewritten to
    match (whoever can write one can write both): --resume refuses it and nothing runs."""
    from autopar.executor.checkpoint.integrity import file_record

    plan, ck = plan_file(tmp_path), tmp_path / "ck"
    proc, _ = cli("run", plan, "--steps", 1, "--checkpoint-dir", ck, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    step = ck / "step-1"
    (step / ".metadata").write_bytes(pickle.dumps(Evil()))
    meta = json.loads((step / "meta.json").read_text())
    meta["files"] = file_record(step, exclude=("meta.json",))
    (step / "meta.json").write_text(json.dumps(meta))
    proc, _ = cli("run", plan, "--steps", 2, "--checkpoint-dir", ck, "--resume", cwd=tmp_path)
    err = _stderr(proc)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(err) == 1 and "refused to load" in err[0] and "system" in err[0], err
    assert not marker.exists()
