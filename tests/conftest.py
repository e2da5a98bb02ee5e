"""Suite-wide set-up: the tests use a graph cache of their own (a fresh directory per session),
so that no result depends on what an earlier run, or the user's own plans, left in
~/.cache/autopar (a cached graph skips the model file's code: a test that expects the file's
prints or errors would pass or fail by the cache's state). Tests that exercise the cache's
location set XDG_CACHE_HOME themselves. Ranks train on the CPU (AUTOPAR_DEVICE=cpu) on any host.

tests/unit runs first: its tests are one process on one core, for minutes, and the zoo's work started
ahead when collection ends (its preparations and run cells, tests/zoo/conftest.py) runs beside them on
the other core. The dist tests' shared spawns start when it ends (session_phases.py), beside tests/cli."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import session_phases

_CACHE_DIR: list[str] = []
FIRST = Path(__file__).resolve().parent / "unit"  # the folder whose tests run before the others'


def pytest_configure(config: pytest.Config) -> None:
    _CACHE_DIR.append(tempfile.mkdtemp(prefix="autopar-test-cache-"))
    os.environ["XDG_CACHE_HOME"] = _CACHE_DIR[0]  # inherited by every subprocess and spawned rank
    # The suite trains on CPU ranks (gloo) even on a GPU host: `autopar run` would take CUDA there
    os.environ.setdefault("AUTOPAR_DEVICE", "cpu")


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _CACHE_DIR:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of ``FIRST`` before the others, each part in the order collected."""
    inside = {id(item) for item in items if _first(item)}
    if inside and len(inside) < len(items):
        items[:] = [item for item in items if id(item) in inside] + [item for item in items if id(item) not in inside]
    session_phases.selected(bool(inside))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The first test after ``FIRST``'s, before its fixtures: that phase is over."""
    if not _first(item):
        session_phases.first_ended()


def _first(item: pytest.Item) -> bool:
    return FIRST in item.path.resolve().parents
