"""A time limit on measuring a model on meta: a model whose tracing cannot finish ends in one line.

Measuring runs the user's code (``build_model()``, the forward and the loss, several times), and
user code can loop forever: a ``while`` on a value that meta tensors never change, a retry loop.
``measure_time_limit(path)`` bounds the whole measurement of one model file; the caller names the
stage it is in (``clock.stage("probing")``) so that the message says where it stopped:

    autopar: error: model.py: tracing the model on the meta device did not finish within 60 s of CPU time; ...

The limit is ``AUTOPAR_TRACE_TIMEOUT_S`` seconds (default ``DEFAULT_LIMIT_S``), or the ``limit_s``
argument, of the process's CPU time, so that a loaded machine (shared CI runners) does not end a
measurement that is merely slow; a wait that uses no CPU (a lock, a sleep) is ended by the wall
clock at ``WALL_FACTOR`` times the limit. Both are interval timers (``SIGPROF``, ``SIGALRM``), so
they are armed only in the main thread (elsewhere the measurement runs unbounded) and interrupt
Python code only (a C call that never returns is not stopped). A timer the caller already armed
is honoured: the earlier deadline stays in charge, and the caller's handlers and remaining times
are put back on the way out.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from autopar.errors import AutoparError, ModelFileError

DEFAULT_LIMIT_S = 60.0
WALL_FACTOR = 5.0  # wall-clock backstop for waits that use no CPU
ENV_VAR = "AUTOPAR_TRACE_TIMEOUT_S"
STAGES = ("building", "probing", "tracing")
_WHAT = {"building": "building the model (build_model())", "probing": "probing the model's structure",
         "tracing": "tracing the model"}
# (timer, signal, what its seconds count)
_TIMERS = (("cpu", signal.ITIMER_PROF, signal.SIGPROF), ("wall", signal.ITIMER_REAL, signal.SIGALRM)) \
    if hasattr(signal, "setitimer") else ()


class _Expired(BaseException):
    """Raised by the timer's handler (a BaseException, so that the user's ``except Exception``
    cannot swallow it). ``args[0]``: "cpu" or "wall"."""


def limit_from_env() -> float:
    """The limit in seconds: ``AUTOPAR_TRACE_TIMEOUT_S`` when set, else ``DEFAULT_LIMIT_S``."""
    raw = os.environ.get(ENV_VAR)
    if raw is None or raw.strip() == "":
        return DEFAULT_LIMIT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise AutoparError(f"{ENV_VAR}={raw!r}: set it to a positive number of seconds")
    return value


def _cpu_s() -> float:
    return time.process_time()


class Clock:
    """The running measurement's stage and deadlines (see ``measure_time_limit``)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.current = "building"
        self.expired_by: str | None = None
        self._deadline = {"cpu": _cpu_s() + limit_s, "wall": time.monotonic() + WALL_FACTOR * limit_s}
        self._armed: dict[str, int] = {}  # kind -> itimer, for the timers this clock owns

    def _now(self, kind: str) -> float:
        return _cpu_s() if kind == "cpu" else time.monotonic()

    @property
    def expired(self) -> bool:
        return self.expired_by is not None or any(self._now(k) >= d for k, d in self._deadline.items())

    def error(self, path: object) -> ModelFileError:
        """The one-line error for running past the limit in the current stage (for callers that
        catch the user's exceptions: the timer's interrupt can reach them wrapped, e.g. by autograd)."""
        kind = self.expired_by or ("cpu" if _cpu_s() >= self._deadline["cpu"] else "wall")
        within = f"{self.limit_s:g} s of CPU time" if kind == "cpu" else f"{WALL_FACTOR * self.limit_s:g} s"
        return ModelFileError(f"{path}: {_WHAT[self.current]} on the meta device did not finish within {within}; "
                              f"fix the loop or wait in the model's code, or raise {ENV_VAR}")

    def stage(self, name: str) -> None:
        """Enter stage ``name`` (one of STAGES). Re-arms the timers with the time left, in case code
        run in the previous stage (a nested guard of its own) disarmed them."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; one of {', '.join(STAGES)}")
        self.current = name
        for kind, which in self._armed.items():
            signal.setitimer(which, max(1e-3, self._deadline[kind] - self._now(kind)))


_ACTIVE: list[Clock] = []  # the clocks of the measurements running now, innermost last


def enter_stage(name: str) -> None:
    """Tell the innermost running measurement (if any) that it entered stage ``name``."""
    if _ACTIVE:
        _ACTIVE[-1].stage(name)


def active_clock() -> Clock | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def measure_time_limit(path: object, limit_s: float | None = None) -> Iterator[Clock]:
    """Bound the body to ``limit_s`` seconds of CPU time (default: ``limit_from_env()``) and
    WALL_FACTOR times that of wall clock; past either, raise a one-line ModelFileError naming
    ``path``, the stage and the limit."""
    limit = limit_from_env() if limit_s is None else float(limit_s)
    if not (math.isfinite(limit) and limit > 0):
        raise AutoparError(f"the tracing time limit must be a positive number of seconds, got {limit_s}")
    clock = Clock(limit)
    usable = threading.current_thread() is threading.main_thread()
    saved: list[tuple[str, int, int, object, float, float]] = []  # kind, itimer, signal, handler, left, t0
    if usable:
        for kind, which, signum in _TIMERS:
            ours = limit if kind == "cpu" else WALL_FACTOR * limit
            left = signal.getitimer(which)[0]
            if 0.0 < left <= ours:
                continue  # the caller's earlier deadline stays in charge

            def on_timer(signo, frame, kind=kind) -> None:  # noqa: ANN001 - signal handler signature
                clock.expired_by = clock.expired_by or kind
                raise _Expired(kind)

            saved.append((kind, which, signum, signal.signal(signum, on_timer), left, clock._now(kind)))
            clock._armed[kind] = which
            signal.setitimer(which, ours)
    _ACTIVE.append(clock)
    try:
        yield clock
    except _Expired:
        raise clock.error(path) from None
    except Exception:
        # Our interrupt, caught and re-raised as something else on its way out (autopar.usercode's
        # guard turns whatever build_model() raises into a ModelFileError; autograd wraps): ours.
        if clock.expired_by is not None:
            raise clock.error(path) from None
        raise
    finally:
        _ACTIVE.remove(clock)
        for kind, which, signum, handler, left, t0 in saved:
            signal.setitimer(which, 0)
        clock._armed.clear()
        for kind, which, signum, handler, left, t0 in saved:
            signal.signal(signum, handler)
            if left > 0.0:  # the caller's timer, less the time we took (fires at once if past)
                signal.setitimer(which, max(1e-3, left - (clock._now(kind) - t0)))
