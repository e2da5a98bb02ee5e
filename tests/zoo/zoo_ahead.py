"""The zoo's 2-rank run cells, run ahead of their tests (tests/zoo/conftest.py starts them).

A run cell (``zoo_lib.run_cell``: ``autopar run --nproc-per-node 2`` of a model's tiny size, compared
with its one-rank reference) is a few processes that take both cores for seconds. The tests before
the zoo's (tests/unit: one process, one core) leave a core idle for minutes, so the cells of the
selected cases run there, one at a time, after the models' preparation (test_zoo._prepare) in the
same one-thread pool; each test still calls ``zoo_lib.run_cell`` and asserts on the Cell it returns.

``install`` puts ``run_cell_ahead`` in ``zoo_lib.run_cell``'s place for the session: a call with
exactly the arguments a cell ran ahead with (the same tiny file, dimension and work folder, the very
Support and reference objects of the model's preparation) returns that run's Cell; a cell not
started yet is taken back and run in the test, as is any call that matches none, and any cell whose
run ahead did not come back (the helper child died or timed out): the test never loses a run.

Each cell runs in a child of its own (``python zoo_ahead.py IN OUT``: ``zoo_lib.run_cell`` on the
pickled arguments), in the environment of the collection's end: a test running meanwhile in this
process may set variables of its own (monkeypatch.setenv: XDG_CACHE_HOME, LOCAL_RANK, ...), which a
run started from a thread here would inherit.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Mapping

HERE = Path(__file__).resolve()
BENCHMARKS = HERE.parents[2] / "benchmarks"
CHILD_SLACK_S = 120.0  # the child's own start and imports, beyond zoo_lib's time limit of the run itself


def _same(args: tuple[Any, ...], ran: tuple[Any, ...]) -> bool:
    """The arguments of a test's call are those a cell ran ahead with: equal paths and dimension,
    and the very Support and reference objects (the model's one preparation)."""
    tiny, support, dim, reference, work = args
    return (Path(tiny) == Path(ran[0]) and dim == ran[2] and Path(work) == Path(ran[4])
            and support is ran[1] and reference is ran[3])


CELLS: dict[tuple[str, str], Future] = {}  # (tiny file, dimension) -> (the arguments it ran with, Cell) or None
_ORIGINAL: list[Callable[..., Any]] = []


def run_in_child(args: tuple[Any, ...], env: Mapping[str, str], timeout_s: float) -> Any:
    """``zoo_lib.run_cell(*args)`` in a child with environment ``env``; its Cell, or None when the
    child did not give one back (the caller then runs the cell itself)."""
    with tempfile.TemporaryDirectory(prefix="autopar-zoo-ahead-") as tmp:
        inp, out = Path(tmp) / "in.pkl", Path(tmp) / "out.pkl"
        inp.write_bytes(pickle.dumps(args))
        proc = subprocess.Popen([sys.executable, str(HERE), str(inp), str(out)], env=dict(env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and the run it started
            proc.wait()
            return None
        return pickle.loads(out.read_bytes()) if out.exists() else None


def run_after(prepared: Future, dim: str, env: Mapping[str, str], timeout_s: float) -> tuple[tuple, Any] | None:
    """(In the pool.) The run cell ``dim`` of the model ``prepared`` (test_zoo._prepare's Future, done
    before this task starts in a one-thread pool): (its arguments, its Cell from ``run_in_child``), or
    None where the test makes no run of its own to stand in for -- the preparation failed (the test
    fails on it first) or the reference did (run_cell then fails at once, in the test)."""
    try:
        state = prepared.result()
    except Exception:  # noqa: BLE001 - the test reports it, from zoo_state
        return None
    if isinstance(state["reference"], Exception):
        return None
    args = (state["tiny"], state["support"], dim, state["reference"], state["work"])
    return args, run_in_child(args, env, timeout_s)


def keep(tiny: Path, dim: str, future: Future) -> None:
    """Keep ``future`` -- a pool's run of the cell (``tiny``, ``dim``), giving (its arguments, its
    Cell) or None -- for the test that calls ``zoo_lib.run_cell`` with them."""
    CELLS[(str(tiny), dim)] = future


def run_cell_ahead(*args: Any) -> Any:
    """``zoo_lib.run_cell`` for a test: the cell run ahead with these very arguments, else a run now."""
    future = CELLS.get((str(args[0]), args[2])) if len(args) == 5 else None
    if future is not None and not future.cancel() and future.exception() is None:
        done = future.result()
        if done is not None and done[1] is not None and _same(args, done[0]):
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


def _child(inp: Path, out: Path) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import zoo_lib

    cell = zoo_lib.run_cell(*pickle.loads(inp.read_bytes()))
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(cell))
    tmp.replace(out)


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]))
