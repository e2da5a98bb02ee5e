"""CP-SAT in a forked process, so that a one-shot command imports OR-Tools while it searches.

Importing ``ortools.sat.python.cp_model`` takes about half a second on the 2-core development
machine (it imports pandas), a fifth of a warm ``autopar plan``, while the programs CP-SAT then
solves take milliseconds. ``overlapped()`` forks a child that pays that import on another core
while the command loads its graph and searches; inside it, ``solve`` hands each CP-SAT program
to the child and waits for its answer. The program is pickled whole before its model is built
(the split ILPs hold only numbers and the frozen terms), the child solves it exactly as the
parent would (``ilp.solve_cp_sat``), and the answer comes back pickled: the same solver, the same
parameters, the same result.

The child starts only where it can pay off and is safe: on Linux (fork, without macOS' fork
caveats), with at least two CPUs, and before OR-Tools was imported in this process (afterwards a
local solve costs nothing extra). Anything wrong with the child (it died, it could not unpickle a
program, it raised) falls back to solving in this process, where an error is raised as before.
The child ignores Ctrl-C (the command handles it) and is closed, or killed if still importing,
when the block ends. ``AUTOPAR_CP_SAT_PROCESS=0`` in the environment solves everything in the
command's own process (the benchmarks compare the two; the plans are the same)."""

from __future__ import annotations

import os
import pickle
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Protocol

CP_SAT_MODULE = "ortools.sat.python.cp_model"
CHILD_GRACE_S = 60.0  # beyond a program's time limit: OR-Tools' import on a loaded machine, with room


class CpSatProgram(Protocol):
    def solve_cp_sat(self, time_limit_s: float) -> Any: ...


class _Child:
    """One forked solver process and its end of a pipe."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child_conn, os.getpid()), daemon=True, name="autopar-cp-sat")
        self.process.start()
        child_conn.close()
        self.lost = False  # the child stopped answering: every program is solved locally

    def solve(self, program: CpSatProgram, time_limit_s: float) -> Any | None:
        """The child's answer, or None if it could not give one (the caller solves locally)."""
        if self.lost:
            return None
        try:
            self.conn.send((program, time_limit_s))
            # The solver's own limit plus the import it may still be in: a child stuck past that
            # is abandoned rather than waited for.
            if not self.conn.poll(time_limit_s + CHILD_GRACE_S):
                self._abandon()
                return None
            status, value = self.conn.recv()
        except (EOFError, OSError, pickle.PicklingError, ValueError, TypeError, AttributeError):
            # PicklingError / ValueError / TypeError / AttributeError: something in it does not pickle.
            return None
        return value if status == "ok" else None

    def _abandon(self) -> None:
        self.lost = True
        self.process.kill()
        self.process.join()
        self.conn.close()

    def close(self) -> None:
        if self.lost:
            return
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.conn.close()
        self.process.join(timeout=0.05)
        if self.process.is_alive():  # still importing OR-Tools, nothing asked of it: not worth waiting
            self.process.kill()
            self.process.join()


_ACTIVE: _Child | None = None


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this child when its parent dies (PR_SET_PDEATHSIG), even by SIGKILL,
    which no handler of the parent sees; a parent already gone by then (``getppid`` changed) ends it
    now. A killed ``plan`` left its 128 MB solver child alive for good before."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(0)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _serve(conn: Any, parent: int) -> None:
    """The child: import CP-SAT at once, then solve programs until told to stop."""
    import signal

    global _ACTIVE
    _ACTIVE = None  # the parent's child object came along with the fork: never route to it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's exit-143 handler
    _die_with_parent(parent)
    __import__(CP_SAT_MODULE)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        except Exception as exc:  # noqa: BLE001 -- it did not unpickle here (a class made after the fork)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        if job is None:
            return
        program, time_limit_s = job
        try:
            conn.send(("ok", program.solve_cp_sat(time_limit_s)))
        except Exception as exc:  # noqa: BLE001 -- the parent re-solves locally and raises it there
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _worth_a_child() -> bool:
    return (sys.platform == "linux" and (os.cpu_count() or 1) >= 2 and CP_SAT_MODULE not in sys.modules
            and os.environ.get("AUTOPAR_CP_SAT_PROCESS", "1") != "0")


@contextmanager
def overlapped() -> Iterator[None]:
    """Within the block, CP-SAT programs go to a forked child that imported OR-Tools meanwhile
    (see the module docstring; a no-op where the child would not pay off). Not re-entrant: an
    inner block runs on the outer one's child."""
    global _ACTIVE
    if _ACTIVE is not None or not _worth_a_child():
        yield
        return
    try:
        child = _Child()
    except OSError:  # no fork here (resource limits): solve locally
        yield
        return
    _ACTIVE = child
    try:
        yield
    finally:
        _ACTIVE = None
        child.close()


def solve(program: CpSatProgram, time_limit_s: float) -> Any:
    """``program.solve_cp_sat(time_limit_s)``, by the child of ``overlapped`` when one runs."""
    if _ACTIVE is not None:
        answer = _ACTIVE.solve(program, time_limit_s)
        if answer is not None:
            return answer
    return program.solve_cp_sat(time_limit_s)
