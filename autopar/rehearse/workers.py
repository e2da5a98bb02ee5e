"""Where a rehearsal's steps run: each in a fresh process of its own (torch keeps process-group
state per process), forked from a server that has imported torch and the executor once.

Spawning a fresh interpreter per step re-imported torch and the executor every time (about 2-4 s a
step on a CPU core, most of a small plan's rehearsal). Python's ``forkserver`` start method forks
each worker from one server process started on first use; ``preload`` makes that server import
``PRELOADED`` first, so a worker starts with them imported and nothing else run: no process group,
no fake tensor mode, no thread pool (importing torch starts none). A forked worker inherits the
server's environment, working directory and import path, not the caller's as a spawned one does,
so every step carries the caller's (``Caller``) and restores them before it runs. Where the
platform has no forkserver, steps are spawned as before.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator

# What every step imports before its work (rehearse.rank.rehearse_step and what it calls).
PRELOADED = ["torch", "torch.distributed", "autopar.executor.parallel.apply", "autopar.executor.runtime.train",
             "autopar.executor.runtime.checks", "autopar.rehearse.rank"]


@dataclass(frozen=True, kw_only=True)
class Caller:
    """The calling process's environment, working directory and import path, for a worker."""

    environ: dict[str, str]
    cwd: str
    path: list[str]

    @staticmethod
    def here() -> "Caller":
        return Caller(environ=dict(os.environ), cwd=os.getcwd(), path=list(sys.path))

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path


def context() -> Any:
    """The multiprocessing context a rehearsal's pool starts its workers with (module docstring)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)  # read when the server starts: the first pool's
    return ctx


@contextlib.contextmanager
def main_left_alone() -> Iterator[None]:
    """While a pool runs: a caller whose main module is no file (``python -`` reading stdin names it
    ``<stdin>``) would have each worker re-import it from that path, and every step fail before it
    starts. The steps need nothing of the caller's main module (they run autopar's own functions),
    so its ``__file__`` is hidden meanwhile; a real script's is left as multiprocessing expects."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str) or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path
