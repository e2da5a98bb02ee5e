"""Fault handling: hangs become errors that name the rank and the collective; test fault injection.

* **Timeouts.** Every process group (the world and each DeviceMesh / pipeline sub-group) gets the
  ``--timeout`` of ``autopar run`` (``set_group_timeouts``; DeviceMesh sub-groups would otherwise
  keep torch's 30-minute default). gloo raises in the waiting rank when a collective exceeds it;
  NCCL's watchdog aborts the communicator.
* **Flight recorder.** ``enable_flight_recorder`` turns on torch's per-process collective trace
  (``TORCH_FR_BUFFER_SIZE``; works for gloo and NCCL). When a phase of training fails with a
  distributed error, ``guard`` reads the trace and raises ``CollectiveFailure``: one line with the
  rank, the phase (``step 4``), the last collective (``gloo:all_reduce`` on ``mesh_dp`` ranks [0, 2],
  sequence number) and what to do. Under ``torchrun --max-restarts R`` the failure makes the job
  restart and resume from the last checkpoint. On NCCL a rank waiting for a hung peer blocks in a
  CUDA sync, not in the collective, and ProcessGroupNCCL's watchdog aborts it at the timeout before
  Python can report: the watchdog dumps the recorder first (``TORCH_NCCL_DUMP_ON_TIMEOUT``) into the
  launcher's status directory, and the launcher's line names the hung rank and that collective
  (launch/flight_recorder.py, launch/local.py).
* **Watchdog.** A daemon thread fails the rank when one phase runs longer than ``2 x timeout + 60 s``
  (a hang in code that holds no collective, or a collective that never times out): it prints the
  same kind of line and ``os._exit(EXIT_FAULT)``.
* **Test hooks** (used by tests/dist/test_fault.py; inert unless set, and only on the first attempt
  ``TORCHELASTIC_RESTART_COUNT == 0``): ``AUTOPAR_TEST_KILL_AT_STEP=k`` + ``AUTOPAR_TEST_KILL_RANK=r``
  makes rank r SIGKILL itself before step index k; ``AUTOPAR_TEST_HANG_AT_STEP`` /
  ``AUTOPAR_TEST_HANG_RANK`` makes it sleep forever instead; ``AUTOPAR_TEST_STOP_AT_STEP`` /
  ``AUTOPAR_TEST_STOP_RANK`` makes it SIGSTOP itself (a frozen process); ``AUTOPAR_TEST_OOM_AT_STEP`` /
  ``AUTOPAR_TEST_OOM_RANK`` makes it raise torch's out-of-memory error; ``AUTOPAR_TEST_NAN_AT_STEP``
  makes every rank's loss of that step NaN (``poison_loss``); ``AUTOPAR_TEST_KILL_IN_SAVE=r`` kills
  rank r inside a checkpoint save (``inject_save_fault``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

from autopar.errors import EXIT_FAULT, AutoparError
from autopar.launch.flight_recorder import CollectiveRecord, dump_prefix, record_from_trace


class CollectiveFailure(AutoparError):
    """A collective timed out or lost a peer (a rank died or hung). Exit code 4."""

    exit_code = EXIT_FAULT


def enable_flight_recorder(entries: int = 2000) -> None:
    """Turn on torch's collective flight recorder. Call before ``init_process_group``. Under
    autopar's launcher (``AUTOPAR_STATUS_DIR``), NCCL's watchdog also dumps it there when a
    collective times out, before it aborts the process (launch/flight_recorder.py): the launcher
    reads those dumps to name the rank that hung and the collective."""
    import torch

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 8):  # the older name; newer torch warns on every rank when it is set
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(entries))
    status_dir = os.environ.get("AUTOPAR_STATUS_DIR")
    if status_dir:
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", dump_prefix(status_dir))


def set_group_timeouts(seconds: float) -> None:
    """Apply ``seconds`` to every process group created so far (world, mesh axes, tied groups)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    td = timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        try:
            c10d._set_pg_timeout(td, group)
        except Exception:  # noqa: BLE001 - a backend without per-group timeouts keeps its own
            pass
    if dist.is_initialized():
        try:
            c10d._set_pg_timeout(td, None)
        except Exception:  # noqa: BLE001
            pass


def _group_table() -> dict[str, tuple[str, str]]:
    """Process-group name -> (description, ranks) for every group of this process."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    out: dict[str, tuple[str, str]] = {}
    for pg, name in list(c10d._world.pg_names.items()):
        try:
            ranks = str(dist.get_process_group_ranks(pg))
        except Exception:  # noqa: BLE001
            ranks = "?"
        out[str(name)] = (str(getattr(pg, "group_desc", "") or name), ranks)
    return out


def _recorder_trace() -> dict | None:
    """This process's recorder as a dict: ProcessGroupNCCL's own recorder where the build has one
    and it holds entries (NCCL records there), else the generic one (gloo); None when off."""
    import torch._C._distributed_c10d as c10d_c

    for fn in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        dump = getattr(c10d_c, fn, None)
        if dump is None:
            continue
        try:
            trace = json.loads(dump(True, False))
        except Exception:  # noqa: BLE001 - disabled or unsupported: try the next
            continue
        if trace.get("entries"):
            return trace
    return None


def last_collective() -> CollectiveRecord | None:
    """The collective this rank failed or is stuck in (launch/flight_recorder.py: on NCCL the oldest
    one not completed, on gloo the newest); None when the recorder is off or empty."""
    try:
        trace = _recorder_trace()
    except Exception:  # noqa: BLE001 - no recorder: no detail
        return None
    if trace is None:
        return None
    try:
        groups = _group_table()
    except Exception:  # noqa: BLE001 - the table is a courtesy
        groups = {}
    return record_from_trace(trace, groups)


# NCCL errors that repeat on a restart (ncclInvalidUsage, ncclInvalidArgument, ncclUnhandledCudaError,
# an out-of-memory in a communicator's set-up): not a lost peer -- exit 4 would make --max-restarts
# start the same failure again and again.
DETERMINISTIC_NCCL = ("invalid usage", "invalid argument", "unhandled cuda error", "out of memory")


def _is_distributed_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost or hung peer (exit 4, restartable), not a failure of this rank."""
    import torch.distributed as dist

    text = str(exc)
    if any(s in text.lower() for s in DETERMINISTIC_NCCL):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    dcp_failure = type(exc).__name__ == "CheckpointException"
    return (isinstance(exc, RuntimeError) or dcp_failure) and any(
        s in text for s in ("Timed out", "timed out", "Connection closed", "Connection reset", "gloo", "NCCL", "Broken pipe")
    )


def failure_message(rank: int, phase: str, timeout_s: float, exc: BaseException | None) -> str:
    """One line: which rank, in which phase, which collective, and what to do."""
    rec = last_collective()
    what = f"collective {rec.describe()}" if rec else "a collective (no flight-recorder trace available)"
    timed_out = exc is None or "imed out" in str(exc)
    how = f"did not complete within --timeout {timeout_s:g} s" if timed_out else "lost a peer"
    text = (str(exc).strip().splitlines() or [""])[0] if exc is not None else ""
    detail = f" [{text[:120]}]" if text else ""
    return (
        f"rank {rank} in {phase}: {what} {how}{detail}; another rank died or hung (see its log); "
        "resume with --resume, or run with --max-restarts R to restart automatically"
    )


class Watchdog:
    """Fails this rank when one phase runs longer than ``limit_s`` (see module docstring)."""

    def __init__(self, rank: int, limit_s: float, timeout_s: float) -> None:
        self.rank, self.limit_s, self.timeout_s = rank, limit_s, timeout_s
        self._phase: str | None = None
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="autopar-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.limit_s / 4)):
            with self._lock:
                phase, since = self._phase, self._since
            if phase is not None and time.monotonic() - since > self.limit_s:
                msg = failure_message(self.rank, phase, self.limit_s, None)
                print(f"autopar: error: watchdog: {msg}", file=sys.stderr, flush=True)
                os._exit(EXIT_FAULT)

    @contextmanager
    def guard(self, phase: str) -> Iterator[None]:
        """Watch ``phase``; turn a distributed error inside it into a one-line CollectiveFailure."""
        from autopar.launch.rank import write_status

        with self._lock:
            self._phase, self._since = phase, time.monotonic()
        write_status(phase)  # where the launcher looks when this rank dies
        try:
            yield
        except (AutoparError, KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if _is_distributed_error(exc):
                raise CollectiveFailure(failure_message(self.rank, phase, self.timeout_s, exc)) from None
            raise
        finally:
            with self._lock:
                self._phase = None

    def stop(self) -> None:
        self._stop.set()


def first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0


def inject_fault(step: int, rank: int) -> None:
    """Test hook (module docstring): kill or hang ``rank`` before step index ``step``."""
    if not first_attempt():
        return
    at, who = os.environ.get("AUTOPAR_TEST_OOM_AT_STEP"), os.environ.get("AUTOPAR_TEST_OOM_RANK", "0")
    if at is not None and int(at) == step and int(who) == rank:
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test hook)")
    for kind in ("KILL", "HANG", "STOP"):
        at, who = os.environ.get(f"AUTOPAR_TEST_{kind}_AT_STEP"), os.environ.get(f"AUTOPAR_TEST_{kind}_RANK", "0")
        if at is not None and int(at) == step and int(who) == rank:
            print(f"autopar: test hook: rank {rank} {kind.lower()}s itself before step {step + 1}", file=sys.stderr, flush=True)
            if kind == "KILL":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "STOP":
                os.kill(os.getpid(), signal.SIGSTOP)
                return
            while True:
                time.sleep(3600)


def inject_save_fault(rank: int) -> None:
    """Test hook: ``AUTOPAR_TEST_KILL_IN_SAVE=r`` SIGKILLs rank r in the first checkpoint save, after
    the shards are written and before the checkpoint is published."""
    who = os.environ.get("AUTOPAR_TEST_KILL_IN_SAVE")
    if who is not None and first_attempt() and int(who) == rank:
        print(f"autopar: test hook: rank {rank} kills itself in a checkpoint save", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def poison_loss(steps_done: int, loss: float) -> float:
    """Test hook (module docstring): NaN instead of the loss of step ``AUTOPAR_TEST_NAN_AT_STEP``."""
    at = os.environ.get("AUTOPAR_TEST_NAN_AT_STEP")
    return float("nan") if at is not None and first_attempt() and int(at) == steps_done else loss
