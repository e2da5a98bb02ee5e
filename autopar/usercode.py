"""Run a user's model-file code under autopar's contract: a time limit, no exits, no stdout.

A model file is the user's code, and autopar calls it while it plans, estimates, profiles and
runs: importing the file, ``build_model()``, ``example_inputs(b)``. That code may hang, call
``sys.exit``, raise a ``BaseException`` of its own, or print. ``user_code(what, path)`` is the one
guard around every such call:

* **Time limit.** ``configure(timeout_s=...)`` (the command's ``--timeout``; default
  ``DEFAULT_TIMEOUT_S``) bounds each call. In the main thread a ``SIGALRM`` timer interrupts the
  call with a one-line ``ModelFileError`` ("did not finish within --timeout S s"). Code that never
  returns to the interpreter (a C call that ignores signals) is stopped by a backstop thread when
  ``hard_exit`` is on (the CLI): it prints the same line and leaves the process with exit code 2
  ``BACKSTOP_S`` seconds later. Nested calls keep the outer deadline.
* **Exits and BaseExceptions.** ``SystemExit`` (``sys.exit(0)`` included) and every other
  exception, ``BaseException`` subclasses too, become one ``ModelFileError`` line naming the file
  and the call (exit code 2). ``KeyboardInterrupt`` is the user's Ctrl-C and passes through (the
  CLI prints one line, exit 130).
* **Stdout isolation.** While the call runs, file descriptor 1 and ``sys.stdout`` point at
  stderr, so a model that prints (from Python or from C) never mixes into ``--json`` output or a
  report on stdout.

The model itself -- its forward, its loss and the backward through them -- is run by autopar's own
code (meta probes, the profiler's timing), which may fail too. ``model_failed`` owns the one line
of a model that failed there ("<file>: the model failed on the meta device: RuntimeError: ...",
"... failed while timing the block at micro-batch 2, tp 1 on cpu: ..."), and ``model_failures``
tells the user's failure from autopar's own by the traceback (``raised_by_model``): an exception is
the model's when the innermost frame that is either the user's code or autopar's is the user's, or
is one of autopar's calls into the model (``calls_model``) with only torch and other libraries
below it (an ``nn.Sequential`` of torch layers has no frame of the user's; an error of autograd's
own engine has no Python frame at all). Anything else stays a traceback: a bug of autopar's.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from contextlib import contextmanager
from types import CodeType, TracebackType
from typing import Callable, Collection, Iterator, TypeVar

from autopar.errors import EXIT_USAGE, AutoparError, ModelFileError

DEFAULT_TIMEOUT_S = 300.0
BACKSTOP_S = 10.0


class _Settings:
    timeout_s: float = DEFAULT_TIMEOUT_S
    hard_exit: bool = False
    depth: int = 0  # nesting of user_code (only the outermost arms the timer)


_settings = _Settings()


class _Timeout(BaseException):
    """Raised by the SIGALRM handler inside the user's code (a BaseException so that the user's own
    ``except Exception`` cannot swallow it)."""


def configure(*, timeout_s: float | None = None, hard_exit: bool | None = None) -> None:
    """Set the time limit of each model-file call (``--timeout``) and whether a call that ignores
    the timer ends the process (CLI) or is left running (library use)."""
    if timeout_s is not None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise AutoparError(f"--timeout must be a positive number of seconds, got {timeout_s}")
        _settings.timeout_s = float(timeout_s)
    if hard_exit is not None:
        _settings.hard_exit = hard_exit


def timeout_s() -> float:
    return _settings.timeout_s


def _cause(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Point fd 1 and ``sys.stdout`` at stderr for the body (prints of user code stay off stdout)."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        saved_fd = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no fd 1 or 2 (embedded interpreter): Python-level redirection only
        saved_fd = None
    saved_obj = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        sys.stdout = saved_obj
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)


def _message(what: str, path: object, limit_s: float) -> str:
    return (f"{path}: {what} did not finish within --timeout {limit_s:g} s; fix the hang in the model file "
            "or raise --timeout")


@contextmanager
def user_code(what: str, path: object, where: str = "") -> Iterator[None]:
    """Run the body as the user's ``what`` of model file ``path`` (see the module docstring);
    ``where`` ("on meta") follows "failed" in the message."""
    outer = _settings.depth == 0
    limit_s = _settings.timeout_s
    use_alarm = outer and threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    done = threading.Event()
    old_handler = None
    if use_alarm:
        def on_alarm(signum, frame):  # noqa: ANN001
            raise _Timeout()

        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit_s)
    if outer and _settings.hard_exit:
        def backstop() -> None:
            if not done.wait(limit_s + BACKSTOP_S):
                print(f"autopar: error: {_message(what, path, limit_s)}", file=sys.__stderr__, flush=True)
                os._exit(EXIT_USAGE)

        threading.Thread(target=backstop, name="autopar-usercode-backstop", daemon=True).start()
    _settings.depth += 1
    try:
        with stdout_to_stderr():
            yield
    except _Timeout:
        raise ModelFileError(_message(what, path, limit_s)) from None
    except AutoparError:
        raise
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:
        raise ModelFileError(f"{path}: {what} called exit({exc.code!r}); a model file must return, not exit") from None
    except BaseException as exc:  # noqa: BLE001 - the user's code: anything it raises is reported in one line
        raise ModelFileError(f"{path}: {what} failed{where}: {_cause(exc)}") from None
    finally:
        _settings.depth -= 1
        done.set()
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)


def model_failed(path: object, during: str, exc: BaseException) -> ModelFileError:
    """The one line of model file ``path`` whose model raised ``exc`` ``during`` something ("on the
    meta device", "while timing the block at micro-batch 2, tp 1 on cpu"): the one wording of every
    command (``autopar plan`` and ``autopar profile`` alike)."""
    return ModelFileError(f"{path}: the model failed {during}: {type(exc).__name__}: {exc}".splitlines()[0])


_F = TypeVar("_F", bound=Callable)
_MODEL_CALLS: set[CodeType] = set()
_AUTOPAR_DIR = os.path.join(os.path.dirname(os.path.realpath(__file__)), "")


def calls_model(fn: _F) -> _F:
    """Mark ``fn`` as one of autopar's calls into the user's model (``call_model``, its backward):
    what is raised below it, through torch and other libraries only, is the model's."""
    _MODEL_CALLS.add(fn.__code__)
    return fn


def raised_by_model(exc: BaseException, user_files: Collection[str]) -> bool:
    """Whether ``exc`` is a failure of the user's model rather than of autopar (module docstring).
    ``user_files``: the paths of the user's code (the model file, the files that define its
    build_model, example_inputs and loss_fn)."""
    users = {os.path.realpath(f) for f in user_files}
    model: bool | None = None  # the innermost frame of the user's or autopar's: the model's? (None: neither seen)
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        name = os.path.realpath(code.co_filename)
        if name in users:
            model = True
        elif name.startswith(_AUTOPAR_DIR):  # a raise in a model call itself (tb_next None) is autopar's
            model = code in _MODEL_CALLS and tb.tb_next is not None
        tb = tb.tb_next
    return bool(model)


@contextmanager
def model_failures(path: object, during: str, user_files: Collection[str]) -> Iterator[None]:
    """Run the body, which runs the user's model on real tensors ``during`` something; a failure of
    the model (``raised_by_model``) becomes ``model_failed``'s one line (exit 2), anything else --
    autopar's own errors, one-line or not, Ctrl-C -- passes through as it is. Mind the time limit:
    ``--timeout`` bounds the calls ``user_code`` guards, not the model's steps timed here."""
    try:
        yield
    except (AutoparError, KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - a model's sys.exit() or BaseException is its failure too
        if raised_by_model(exc, user_files):
            raise model_failed(path, during, exc) from None
        raise


def positive_seconds(text: str) -> float:
    """argparse type of ``--timeout``: a positive, finite number of seconds."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_timeout_argument(parser, default: float = DEFAULT_TIMEOUT_S) -> None:  # noqa: ANN001
    parser.add_argument("--timeout", type=positive_seconds, default=default, metavar="S",
                        help=f"time limit of each call into the model file: import, build_model, example_inputs "
                             f"(default {default:g} s); a hang becomes a one-line error")
