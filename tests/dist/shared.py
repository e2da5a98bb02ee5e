"""One spawn per world size for the whole test session.

A process group costs seconds to start on a shared CPU (the processes, ``import torch``, gloo's
rendezvous, the model files' imports), and most of the distributed tests need little more than that
once started. So the test modules declare at import what they need run on ``world`` ranks --
``share(world, items)``: harness Cases (trained by ``harness._run_case``) and Jobs (a module's own
function) -- and the first ``result(world, item)`` of the session runs every item declared for that
world in one spawn, in the order declared; the later ones read the results kept for the session.

The spawns start as soon as pytest has collected (``start_ahead``, called by conftest.py), one world
after the other in a thread, while the tests collected before the distributed ones run (the CLI's,
which mostly leave a core idle); ``result`` waits for its world's.

Only the items the selected tests use run in it (``select``, called by conftest.py once pytest has
collected): an item of a parametrized test runs when that test is selected (with the Jobs that go
with it), every item of a module when any test of it without such a parameter is; and the items
they need. An item asked for that did not run (selected by a
path the rule does not foresee, or the module used outside pytest) runs in a spawn of its own: the
selection changes the time, never a result.

A Python error in one item reports that item and the spawn goes on with the rest in a fresh one
(``harness.spawn_named(keep_going=True)``), so one broken module does not fail the others' tests.
Each item must leave the ranks as it found them (the process environment, patched functions), since
later items of other modules run in the same processes.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
from harness import Case, _on_host, _run_case, gloo_rank, spawn_named


@dataclass(frozen=True)
class Job:
    """A named piece of work for a shared spawn: ``fn(work_dir, *args)`` runs on every rank (``fn``
    a module-level function, so that the ranks can unpickle it) and returns that rank's result;
    the test gets the list of the ranks' results. ``work_dir`` is the spawn's scratch folder, the
    same for every item of the spawn (name what you put there after the job)."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = field(default=())
    needs: tuple[str, ...] = field(default=())  # items declared before it whose files it reads
    goes_with: str | None = None  # the item whose tests read this one too: selected whenever it is


Item = Case | Job
_DECLARED: dict[int, dict[str, tuple[str, Item]]] = {}  # world -> item name -> (declaring module, item)
_SELECTED: set[str] | None = None  # the names to run in the shared spawns; None: every declared one
_RESULTS: dict[int, dict[str, Any]] = {}  # world -> item name -> result (or error text), once spawned
_AHEAD: dict[int, Future] = {}  # world -> its spawn's results, started by start_ahead
_POOL: list[ThreadPoolExecutor] = []
_ENV: list[dict[str, str]] = []  # the environment the spawns get, taken by start_ahead
_LOGS: dict[int, list[str]] = {}  # world -> the ranks' output of its spawns, not printed yet


def share(world: int, items: list[Item]) -> list[Item]:
    """Declare ``items`` for the session's spawn of ``world`` ranks (at a test module's import);
    returns them. A name is a file name in the spawn's folder: two different items may not share one."""
    owner = sys._getframe(1).f_globals.get("__name__", "?")  # noqa: SLF001 - the declaring module
    declared = _DECLARED.setdefault(world, {})
    for item in items:
        if item.name in declared and declared[item.name][1] != item:
            raise ValueError(f"two items named {item.name!r} on {world} ranks ({declared[item.name][0]}, {owner})")
        declared[item.name] = (owner, item)
    return items


def select(tests: list[Any]) -> None:
    """Keep to the shared spawns the items the selected ``tests`` (pytest items) use."""
    global _SELECTED
    names = {name for d in _DECLARED.values() for name in d}
    chosen: set[str] = set()
    whole: set[str] = set()
    for test in tests:
        spec = getattr(test, "callspec", None)
        params = [v for v in (spec.params.values() if spec else ()) if isinstance(v, (Case, Job, str))]
        used = {v if isinstance(v, str) else v.name for v in params} & names
        if used:
            chosen |= used
        elif getattr(test, "module", None) is not None:
            whole.add(test.module.__name__)
    chosen |= {name for d in _DECLARED.values() for name, (owner, _) in d.items() if owner in whole}
    chosen |= {name for d in _DECLARED.values() for name, (_, it) in d.items() if getattr(it, "goes_with", None) in chosen}
    _SELECTED = {it.name for world, d in _DECLARED.items() for it in _with_needs(world, chosen & set(d))}


def _with_needs(world: int, names: set[str]) -> list[Item]:
    """The items ``names`` of ``world`` and those they need, in the order declared."""
    declared = _DECLARED.get(world, {})
    todo, closed = list(names), set()
    while todo:
        name = todo.pop()
        if name not in closed:
            closed.add(name)
            item = declared.get(name, (None, None))[1]
            todo.extend(getattr(item, "needs", ()))
    return [it for name, (_, it) in declared.items() if name in closed]


def _session_spawn(world: int) -> dict[str, Any]:
    todo = [it for name, (_, it) in _DECLARED.get(world, {}).items() if _SELECTED is None or name in _SELECTED]
    return _spawn(world, todo) if todo else {}


def start_ahead() -> None:
    """Start the session's spawns now, in a thread, one world after the other (the smallest first:
    the order the test files ask for them), each with the items selected (``select``)."""
    worlds = sorted(w for w, d in _DECLARED.items() if _SELECTED is None or _SELECTED & set(d))
    if not worlds or _POOL:
        return
    _ENV.append(dict(os.environ))
    _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="shared-spawn"))
    for world in worlds:
        _AHEAD[world] = _POOL[0].submit(_session_spawn, world)


def stop_ahead() -> None:
    """The session ends: drop the spawns not started yet, wait for the one running."""
    for pool in _POOL:
        pool.shutdown(wait=True, cancel_futures=True)


def result(world: int, item: Item) -> Any:
    """``item``'s result on ``world`` ranks: a Case's result dict, a Job's list of per-rank results,
    or the error text. The first call for a world waits for the session's spawn of it (started
    ahead), or runs it."""
    if world not in _RESULTS:
        ahead = _AHEAD.get(world)
        _RESULTS[world] = ahead.result() if ahead is not None and not ahead.cancelled() else _session_spawn(world)
    done = _RESULTS[world]
    if item.name not in done:
        # what it needs runs again: the spawn's folder, and the files they left there, are gone
        done.update(_spawn(world, _with_needs(world, {item.name}) or [item]))
    for text in _LOGS.pop(world, []):  # captured with this test's output, as a spawn run in it was
        print(text, file=sys.stderr)
    return done[item.name]


def _spawn(world: int, items: list[Item]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"autopar-shared{world}-") as out_dir:
        worker = functools.partial(_worker, env=_ENV[0] if _ENV else dict(os.environ))
        try:
            return spawn_named(worker, world, items, out_dir, keep_going=True)
        finally:
            logs = sorted(Path(out_dir).glob("rank*.log"))
            _LOGS.setdefault(world, []).extend(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in logs)


def _worker(rank: int, world: int, port: int, items: list[Item], out_dir: str, env: dict[str, str]) -> None:
    # the session's environment, not what a test running in the main thread beside a spawn started
    # ahead may have set (monkeypatch.setenv: RANK, WORLD_SIZE, TORCHELASTIC_USE_AGENT_STORE, ...)
    os.environ.clear()
    os.environ.update(env)
    # the ranks' output to a file, which result() prints in the test that reads the spawn first (a spawn
    # started ahead runs outside any test, where pytest would not capture it)
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.flush()
        os.dup2(log, fd)
    os.close(log)
    with gloo_rank(rank, world, port):
        for item in items:
            try:
                if isinstance(item, Job):
                    _run_job(item, Path(out_dir))
                else:
                    _run_case(item, Path(out_dir))
            except BaseException:
                (Path(out_dir) / f"{item.name}.err").write_text(traceback.format_exc())
                raise


def _run_job(job: Job, out_dir: Path) -> None:
    import torch

    mine = _on_host(job.fn(out_dir, *job.args))
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    if dist.get_rank() == 0:
        torch.save(everything, out_dir / f"{job.name}.pt")
    dist.barrier()
