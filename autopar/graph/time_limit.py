"""A time limit on measuring a model on meta: a model whose tracing cannot finish ends in one line.

Measuring runs the user's code (``build_model()``, the forward and the loss, several times), and
user code can loop forever: a ``while`` on a value that meta tensors never change, a retry loop.
``measure_time_limit(path)`` bounds the whole measurement of one model file; the caller names the
stage it is in (``clock.stage("probing")``) so that the message says where it stopped:

    autopar: error: model.py: tracing the model on the meta device did not finish within 60 s ...

The limit is ``AUTOPAR_TRACE_TIMEOUT_S`` seconds (default ``DEFAULT_LIMIT_S``), or the
``limit_s`` argument. It is a ``SIGALRM`` timer, so it is armed only in the main thread (elsewhere
the measurement runs unbounded) and only interrupts Python code (a C call that never returns is
not stopped). A timer already armed by the caller is honoured: the earlier deadline wins, and the
caller's handler and remaining time are put back on the way out.
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

DEFAULT_LIMIT_S = 120.0  # wall clock: generous for a loaded machine; a one-block meta trace takes seconds
ENV_VAR = "AUTOPAR_TRACE_TIMEOUT_S"
STAGES = ("building", "probing", "tracing")
_WHAT = {"building": "building the model (build_model())", "probing": "probing the model's structure",
         "tracing": "tracing the model"}


class _Expired(BaseException):
    """Raised by the SIGALRM handler (a BaseException, so the user's ``except Exception`` cannot
    swallow it)."""


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


class Clock:
    """The running measurement's stage and deadline (see ``measure_time_limit``)."""

    def __init__(self, limit_s: float, deadline: float, armed: bool) -> None:
        self.limit_s = limit_s
        self.deadline = deadline
        self.armed = armed
        self.current = "building"

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def error(self, path: object) -> ModelFileError:
        """The one-line error for running past the limit in the current stage (for callers that
        catch the user's exceptions: the timer's interrupt can reach them wrapped, e.g. by autograd)."""
        return ModelFileError(_message(path, self.current, self.limit_s))

    def stage(self, name: str) -> None:
        """Enter stage ``name`` (one of STAGES). Re-arms the timer with the time left, in case code
        run in the previous stage (a nested guard) disarmed it."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; one of {', '.join(STAGES)}")
        self.current = name
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, self.deadline - time.monotonic()))


def _message(path: object, stage: str, limit_s: float) -> str:
    return (f"{path}: {_WHAT[stage]} on the meta device did not finish within {limit_s:g} s; "
            f"fix the loop or wait in the model's code, or raise {ENV_VAR}")


@contextmanager
def measure_time_limit(path: object, limit_s: float | None = None) -> Iterator[Clock]:
    """Bound the body to ``limit_s`` seconds (default: ``limit_from_env()``); past it, raise a
    one-line ModelFileError naming ``path``, the stage and the limit."""
    limit = limit_from_env() if limit_s is None else float(limit_s)
    if not (math.isfinite(limit) and limit > 0):
        raise AutoparError(f"the tracing time limit must be a positive number of seconds, got {limit_s}")
    start = time.monotonic()
    usable = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    outer_left_s = signal.getitimer(signal.ITIMER_REAL)[0] if usable else 0.0
    # An earlier deadline of the caller's stays in charge: we neither replace nor re-arm it.
    armed = usable and not (0.0 < outer_left_s <= limit)
    clock = Clock(limit, start + limit, armed)
    old_handler = None
    if armed:
        def on_alarm(signum, frame) -> None:  # noqa: ANN001 - signal handler signature
            raise _Expired()

        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield clock
    except _Expired:
        raise clock.error(path) from None
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if outer_left_s > 0.0:  # the caller's timer, less the time we took (fires now if past)
                signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer_left_s - (time.monotonic() - start)))
