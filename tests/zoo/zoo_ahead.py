"""The zoo's work done ahead of its tests: each model's preparation (test_zoo._prepare) and then the
selected cases' 2-rank run cells (zoo_lib.run_cell), one at a time, in one helper process (the lane).

tests/zoo/conftest.py starts the lane when collection ends and queues the work in a one-thread pool;
tests/unit, which runs first (tests/conftest.py), is one process on one core for minutes, and the lane
runs on the other core meanwhile.

Why one helper process, started before any test: what it starts (the preparations' children, the
run cells' ``autopar run`` and ranks) are its children, never the pytest process's -- a unit test may
compare the pytest process's children before and after (tests/unit/test_contention.py) -- and it has
the environment of the collection's end, not the variables a test running meanwhile sets
(monkeypatch.setenv: XDG_CACHE_HOME, LOCAL_RANK, ...).

``install`` puts ``run_cell_ahead`` in ``zoo_lib.run_cell``'s place for the session: a call with
exactly the arguments a cell ran ahead with (the same tiny file, dimension and work folder, the very
Support and reference objects of the model's preparation) returns that run's Cell. A cell not started
yet is taken back and run in the test, as is any call that matches none and any cell the lane gave no
answer for: the test never loses a run, and each test still asserts on its own cell.
"""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

HERE = Path(__file__).resolve()
BENCHMARKS = HERE.parents[2] / "benchmarks"


class LaneError(RuntimeError):
    """The lane gave no answer (it died, or could not send one back)."""


def _send(stream: BinaryIO, value: Any) -> None:
    data = pickle.dumps(value)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the lane closed its end")
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the lane closed its end")
    return pickle.loads(data)


class Lane:
    """The helper process: ``call("module.function", *args)`` runs it there and returns its value (or
    raises its exception). One caller at a time (the zoo's one-thread pool)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, str(HERE)], env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def call(self, name: str, *args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            _send(self.proc.stdin, (name, args))
            ok, value = _receive(self.proc.stdout)
        except (OSError, ValueError, EOFError, pickle.PickleError) as exc:
            raise LaneError(f"the zoo's lane gave no answer for {name}: {exc}") from exc
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()  # the lane ends after the call it is in
            except OSError:
                pass
        try:
            self.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def prepare(lane: Lane, fallback: Callable[..., dict], name: str, work: Path) -> dict:
    """(In the pool.) test_zoo._prepare(name, work) in the lane; run here (``fallback``) only if the
    lane gave no answer. Its own errors (ZooError) are raised as they are."""
    try:
        return lane.call("test_zoo._prepare", name, work)
    except LaneError:
        return fallback(name, work, lane.env)


def run_after(lane: Lane, prepared: Future, dim: str) -> tuple[tuple, Any] | None:
    """(In the pool.) The run cell ``dim`` of the model ``prepared`` (its preparation's Future, done
    before this task starts in a one-thread pool), in the lane: (its arguments, its Cell), or None
    where the test makes no run that this one stands in for -- the preparation failed (the test fails
    on it first) or the reference did (run_cell then fails at once, in the test) -- or the lane gave
    no Cell (the test then runs the cell itself)."""
    try:
        state = prepared.result()
    except Exception:  # noqa: BLE001 - the test reports it, from zoo_state
        return None
    if isinstance(state["reference"], Exception):
        return None
    args = (state["tiny"], state["support"], dim, state["reference"], state["work"])
    try:
        return args, lane.call("zoo_lib.run_cell", *args)
    except Exception:  # noqa: BLE001 - no answer, or run_cell's own failure: the test runs it again
        return None


def _same(args: tuple[Any, ...], ran: tuple[Any, ...]) -> bool:
    """The arguments of a test's call are those a cell ran ahead with: equal paths and dimension,
    and the very Support and reference objects (the model's one preparation)."""
    tiny, support, dim, reference, work = args
    return (Path(tiny) == Path(ran[0]) and dim == ran[2] and Path(work) == Path(ran[4])
            and support is ran[1] and reference is ran[3])


CELLS: dict[tuple[str, str], Future] = {}  # (tiny file, dimension) -> run_after's Future
_ORIGINAL: list[Callable[..., Any]] = []


def keep(tiny: Path, dim: str, future: Future) -> None:
    """Keep ``future`` (``run_after`` of the cell ``tiny``, ``dim``) for the test that calls
    ``zoo_lib.run_cell`` with them."""
    CELLS[(str(tiny), dim)] = future


def run_cell_ahead(*args: Any) -> Any:
    """``zoo_lib.run_cell`` for a test: the cell run ahead with these very arguments, else a run now."""
    future = CELLS.get((str(args[0]), args[2])) if len(args) == 5 else None
    if future is not None and not future.cancel():
        done = future.result()
        if done is not None and _same(args, done[0]):
            return done[1]
    return _ORIGINAL[0](*args)


def install(zoo_lib: Any) -> None:
    """Put ``run_cell_ahead`` in ``zoo_lib.run_cell``'s place (until ``uninstall``)."""
    if not _ORIGINAL:
        _ORIGINAL.append(zoo_lib.run_cell)
        zoo_lib.run_cell = run_cell_ahead


def uninstall(zoo_lib: Any) -> None:
    if _ORIGINAL:
        zoo_lib.run_cell = _ORIGINAL.pop()
    CELLS.clear()


def _serve() -> None:
    """(The lane.) Answer each call read from stdin with (True, value) or (False, exception) on the
    descriptor stdout was; what the work itself prints goes to stderr."""
    sys.path[:0] = [str(HERE.parent), str(BENCHMARKS)]  # test_zoo, zoo_lib
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    while True:
        try:
            name, args = _receive(requests)
        except EOFError:
            return
        module, function = name.rsplit(".", 1)
        try:
            reply = (True, getattr(importlib.import_module(module), function)(*args))
        except Exception as exc:  # noqa: BLE001 - the caller raises it
            reply = (False, exc)
        try:
            _send(answers, reply)
        except (pickle.PickleError, TypeError, AttributeError) as exc:
            _send(answers, (False, LaneError(f"{name}'s answer could not be sent: {exc}")))


if __name__ == "__main__":
    _serve()
