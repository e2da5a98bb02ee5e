"""The single-node launcher of ``autopar run``, ``autopar validate`` and ``autopar profile --comm``:
start, watch and stop the ranks (``run_local``); what a rank does to join and report is
autopar.launch.rank.

Why not ``torchrun --standalone``: its rendezvous store listens on every interface of the host,
a rank death comes back as torchrun's own exit code 1 with a 41-line traceback, and a SIGTERM to
the parent leaves torchrun and the ranks training. This launcher keeps torchrun's environment
contract for the ranks (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_RUN_ID``), so the
rank code is the same under either, and adds:

* **Loopback only.** The launcher binds the store's listening socket to ``127.0.0.1`` and hands
  its file descriptor to rank 0 (``AUTOPAR_STORE_FD``), which serves the TCPStore on it
  (``master_listen_fd``); gloo and NCCL's bootstrap are pinned to the loopback interface
  (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, unless set). No socket of the job listens beyond
  loopback.
* **One contract for failures.** Each rank's stderr passes through, except its
  ``autopar: error:`` lines, which are collected. When a rank fails, the others get
  ``REPORT_GRACE_S`` to report their own view, then are stopped. The launcher prints one line
  and exits with 4 for a rank that died or hung (naming the rank that died, its last phase from
  its status file, and the collective the survivors were in), 2 when the ranks reported bad input
  (a damaged checkpoint, NaN losses), 1 for an internal error of a rank. Ranks that NCCL's
  watchdog aborted at a collective timeout (SIGABRT, after dumping their flight recorder into the
  status directory: flight_recorder.py) are survivors, not the rank that died: the line names the
  rank they waited for and the collective, read from their dumps.
* **Restarts.** ``max_restarts`` > 0: after a fault the whole job is started again (a warning
  line), ``TORCHELASTIC_RESTART_COUNT`` counting up; the ranks resume from the last checkpoint.
* **Signals.** SIGTERM, SIGINT and SIGHUP to the launcher are forwarded to every rank (each in
  its own process group, so its children stop too); the launcher waits ``STOP_GRACE_S`` for them,
  then kills what is left, prints one line and exits ``128 + signal``. Ranks also arm
  ``PR_SET_PDEATHSIG`` (Linux, ``launch.rank.arm_parent_death_signal``): if the launcher itself is killed, they
  die with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from autopar.errors import EXIT_FAULT, EXIT_INTERNAL, EXIT_OK, EXIT_OUT_OF_MEMORY, EXIT_SIGNAL, EXIT_USAGE
from autopar.launch.flight_recorder import CollectiveRecord, rank_dump, read_dump

REPORT_GRACE_S = 3.0  # after the first failure: time the other ranks get to exit with their own line
STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL
ERROR_PREFIX = "autopar: error: "
RESUME_HINT = "resume with --resume, or run with --max-restarts to restart"  # ends a fault's line


@dataclass(frozen=True, kw_only=True)
class LocalJob:
    """``nproc`` ranks of ``python <argv...>`` on this host."""

    argv: tuple[str, ...]  # after the interpreter, e.g. ("-m", "autopar", "run", "plan.yaml", ...)
    nproc: int
    max_restarts: int = 0
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.max_restarts < 0:
            raise ValueError("nproc must be >= 1 and max_restarts >= 0")


def loopback_interface() -> str | None:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS), None when unknown."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), next((n for n in names if n.startswith("lo")), None))


@dataclass(kw_only=True)
class _Rank:
    rank: int
    proc: subprocess.Popen
    errors: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def exited(self) -> int | None:
        return self.proc.poll()


def _pump(r: _Rank) -> None:
    """Forward a rank's stderr, keeping its ``autopar: error:`` lines for the launcher's verdict."""
    assert r.proc.stderr is not None
    for raw in r.proc.stderr:
        line = raw.decode("utf-8", "replace")
        if line.startswith(ERROR_PREFIX):
            r.errors.append(line[len(ERROR_PREFIX):].strip())
            continue
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _phase(status_dir: Path, rank: int) -> str | None:
    try:
        return (status_dir / f"rank{rank}").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


class _Stopper:
    """Records the first of SIGTERM/SIGINT/SIGHUP; the main loop forwards it to the ranks."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> "_Stopper":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:  # noqa: ANN001
        if self.signum is None:
            self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _stop(ranks: Sequence[_Rank], signum: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> None:
    """Signal every live rank's process group, wait up to ``grace_s``, then SIGKILL the rest."""
    for r in ranks:
        if r.exited() is None:
            try:
                os.killpg(r.proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + grace_s
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for r in ranks:
        if r.exited() is None:
            for kill in (lambda: os.killpg(r.proc.pid, signal.SIGKILL), r.proc.kill):
                try:
                    kill()
                except (ProcessLookupError, PermissionError, OSError):
                    pass
            r.proc.wait()
    for r in ranks:
        if r.reader is not None:
            r.reader.join(timeout=2.0)


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What one attempt came to: the exit code and the one line that explains it (None on success)."""

    code: int
    line: str | None


def _watchdog_aborts(dead: Sequence[_Rank], codes: Mapping[int, int | None],
                     status_dir: Path) -> dict[int, tuple[CollectiveRecord | None, bool]]:
    """Ranks NCCL's watchdog aborted after a collective timed out: dead by SIGABRT with the flight
    recorder dump it writes first (flight_recorder.py) -> (their stuck collective, anything pending)."""
    out: dict[int, tuple[CollectiveRecord | None, bool]] = {}
    for r in dead:
        if codes[r.rank] == -signal.SIGABRT:
            got = read_dump(rank_dump(status_dir, r.rank))
            if got is not None:
                out[r.rank] = got
    return out


def _hang_verdict(aborted: Mapping[int, tuple[CollectiveRecord | None, bool]], hung: Sequence[int],
                  status_dir: Path) -> Outcome:
    """Every dead rank was aborted by NCCL's watchdog: the root cause is a rank that never joined --
    one still running (stopped by the launcher) or one aborted with no collective pending."""
    waiting = sorted(r for r, (_, pending) in aborted.items() if pending)
    culprits = list(hung) or sorted(r for r, (_, pending) in aborted.items() if not pending)
    waited = next((aborted[r][0] for r in waiting if aborted[r][0] is not None), None)
    if culprits:
        who = f"rank{'s' if len(culprits) > 1 else ''} {', '.join(map(str, culprits))}"
        where = _phase(status_dir, culprits[0])
        line = f"{who} hung" + (f" in {where}" if where else "")
        if waited is not None:
            line += (f"; rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} waited for it in "
                     f"collective {waited.describe()} until NCCL's watchdog aborted them after --timeout")
        return Outcome(code=EXIT_FAULT, line=f"{line}; {RESUME_HINT}")
    stuck = "; ".join(f"rank {r} in {rec.describe()}" for r, (rec, _) in sorted(aborted.items()) if rec is not None)
    return Outcome(code=EXIT_FAULT, line=f"every rank timed out inside a collective (NCCL's watchdog aborted them: "
                   f"{stuck or 'no trace'}); the ranks issued different collectives; {RESUME_HINT}")


def _verdict(ranks: Sequence[_Rank], first: _Rank | None, status_dir: Path, stopped_after: set[int]) -> Outcome:
    codes = {r.rank: r.exited() for r in ranks}
    if first is None and all(c == 0 for c in codes.values()):
        return Outcome(code=EXIT_OK, line=None)
    dead = [r for r in ranks if (codes[r.rank] or 0) < 0 and r.rank not in stopped_after]
    faults = [e for r in ranks if codes[r.rank] == EXIT_FAULT for e in r.errors]
    usage = [e for r in ranks if codes[r.rank] == EXIT_USAGE for e in r.errors]
    oom = [e for r in ranks if codes[r.rank] == EXIT_OUT_OF_MEMORY for e in r.errors]
    hung = sorted(stopped_after)
    tail = (f"; rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} "
            f"{'were' if len(hung) > 1 else 'was'} still running (hung) and {'were' if len(hung) > 1 else 'was'} stopped"
            if hung else "")
    aborted = _watchdog_aborts(dead, codes, status_dir)
    if aborted:  # NCCL's watchdog took these down: survivors, not the root cause
        dead = [r for r in dead if r.rank not in aborted]
        if not dead:
            return _hang_verdict(aborted, hung, status_dir)
    if dead:
        d = dead[0]
        where = _phase(status_dir, d.rank)
        line = f"rank {d.rank} died ({_signal_name(codes[d.rank])})" + (f" in {where}" if where else "")
        waited = next((rec for rec, _ in aborted.values() if rec is not None), None)
        if faults:
            line += f"; {faults[0]}"
        elif waited is not None:
            line += f"; the others waited for it in collective {waited.describe()} until NCCL's watchdog aborted them; {RESUME_HINT}"
        else:
            line += f"; the other ranks were stopped; {RESUME_HINT}"
        return Outcome(code=EXIT_FAULT, line=line)
    if oom:  # the root cause: the others then lose it as a peer
        return Outcome(code=EXIT_OUT_OF_MEMORY, line=oom[0])
    if usage and (first is None or codes[first.rank] == EXIT_USAGE):
        # bad input found by a rank (a damaged checkpoint, a NaN loss): the root cause, even when
        # the other ranks then lost it as a peer
        return Outcome(code=EXIT_USAGE, line=usage[0])
    if faults:
        return Outcome(code=EXIT_FAULT, line=faults[0] + tail)
    if usage:
        return Outcome(code=EXIT_USAGE, line=usage[0])
    assert first is not None
    code = codes[first.rank]
    errors = [e for r in ranks for e in r.errors]
    if errors:
        return Outcome(code=code if code in (EXIT_USAGE, EXIT_FAULT, EXIT_OUT_OF_MEMORY) else EXIT_INTERNAL,
                       line=errors[0])
    where = _phase(status_dir, first.rank)
    return Outcome(code=EXIT_INTERNAL, line=f"rank {first.rank} failed with exit code {code}"
                   + (f" in {where}" if where else "") + " (an internal error: its output is above; please report it)")


def rank_env(job: LocalJob, attempt: int, run_id: str, status_dir: Path, port: int, lo: str | None) -> dict[str, str]:
    """The environment every rank of an attempt starts from (torchrun's contract plus ours). With a
    loopback interface ``lo``, gloo and NCCL's bootstrap sockets are pinned to it (NCCL otherwise
    listens on the first non-loopback interface; its data goes over NVLink / shared memory on one
    node either way) unless the user chose an interface."""
    base = dict(os.environ, **job.env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(job.nproc),
                LOCAL_WORLD_SIZE=str(job.nproc), GROUP_RANK="0", ROLE_RANK="0", ROLE_WORLD_SIZE=str(job.nproc),
                TORCHELASTIC_RESTART_COUNT=str(attempt), TORCHELASTIC_MAX_RESTARTS=str(job.max_restarts),
                TORCHELASTIC_RUN_ID=run_id, AUTOPAR_STATUS_DIR=str(status_dir), AUTOPAR_LOOPBACK_STORE="1",
                AUTOPAR_LAUNCHER_PID=str(os.getpid()))
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if lo:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if var not in job.env and var not in os.environ:
                base[var] = lo
    return base


def _attempt(job: LocalJob, attempt: int, run_id: str, status_dir: Path, stopper: _Stopper) -> Outcome | int:
    """Run the job once; an Outcome, or the signal number that stopped it."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(max(128, job.nproc * 4))
    port = listener.getsockname()[1]
    base = rank_env(job, attempt, run_id, status_dir, port, loopback_interface())
    ranks: list[_Rank] = []
    try:
        for rank in range(job.nproc):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_NAME="default")
            fds: tuple[int, ...] = ()
            if rank == 0:
                env["AUTOPAR_STORE_FD"] = str(listener.fileno())
                fds = (listener.fileno(),)
            proc = subprocess.Popen([sys.executable, *job.argv], env=env, stderr=subprocess.PIPE, pass_fds=fds,
                                    start_new_session=True)
            ranks.append(_Rank(rank=rank, proc=proc))
        for r in ranks:  # after every fork: no reader thread runs while the launcher forks
            r.reader = threading.Thread(target=_pump, args=(r,), name=f"autopar-rank{r.rank}-stderr", daemon=True)
            r.reader.start()
    except BaseException:
        _stop(ranks, signal.SIGKILL, 0.0)
        raise
    finally:
        listener.close()  # rank 0 holds its own copy of the descriptor
    first: _Rank | None = None
    deadline: float | None = None
    try:
        while True:
            if stopper.signum is not None:
                _stop(ranks, signal.SIGTERM)
                return stopper.signum
            live = [r for r in ranks if r.exited() is None]
            if first is None:
                first = next((r for r in ranks if r.exited() not in (None, 0)), None)
                if first is not None:
                    deadline = time.monotonic() + REPORT_GRACE_S
            if not live:
                break
            if deadline is not None and time.monotonic() > deadline:
                stopped = {r.rank for r in live}
                _stop(ranks, signal.SIGTERM, 1.0)
                return _verdict(ranks, first, status_dir, stopped)
            time.sleep(0.05)
    except BaseException:
        _stop(ranks, signal.SIGKILL, 0.0)
        raise
    for r in ranks:
        if r.reader is not None:
            r.reader.join(timeout=5.0)
    return _verdict(ranks, first, status_dir, set())


def run_local(job: LocalJob) -> int:
    """Run ``job`` with restarts and signal forwarding (module docstring). Returns the exit code;
    prints at most one ``autopar: error:`` line (plus one warning per restart)."""
    run_id = f"autopar-{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="autopar-status-") as tmp, _Stopper() as stopper:
        status_dir = Path(tmp)
        attempt = 0
        while True:
            result = _attempt(job, attempt, run_id, status_dir, stopper)
            if isinstance(result, int):
                name = signal.Signals(result).name
                print(f"{ERROR_PREFIX}interrupted by {name}: stopped all {job.nproc} ranks; completed checkpoints "
                      "are kept (resume with --resume)", file=sys.stderr, flush=True)
                return EXIT_SIGNAL + result
            if result.code == EXIT_FAULT and attempt < job.max_restarts:
                attempt += 1
                print(f"autopar: warning: {result.line}; restarting the job (restart {attempt} of "
                      f"{job.max_restarts})", file=sys.stderr, flush=True)
                for f in status_dir.iterdir():
                    f.unlink(missing_ok=True)
                continue
            if result.line is not None:
                print(f"{ERROR_PREFIX}{result.line}", file=sys.stderr, flush=True)
            return result.code
