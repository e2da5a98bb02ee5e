"""The session's first phase, tests/unit (tests/conftest.py runs it first): work that must not start
beside it waits for its end (``after_first``).

The dist tests' shared spawns (tests/dist/shared.py) start their ranks as children of the pytest
process, from a thread; beside tests/unit they would appear and go while a unit test compares the
pytest process's children before and after (tests/unit/test_contention.py). They start when the
first test after tests/unit starts, beside tests/cli, as they did when the CLI's tests came first."""

from __future__ import annotations

from typing import Callable

_WAITING: list[Callable[[], None]] = []
_STATE = {"first": False, "ended": False}  # a first phase selected; that phase over


def selected(first: bool) -> None:
    """(tests/conftest.py, once collected) whether the session has a first phase."""
    _STATE["first"], _STATE["ended"] = first, False


def after_first(start: Callable[[], None]) -> None:
    """Call ``start`` when the first phase has ended (now, if there is none or it has)."""
    if _STATE["ended"] or not _STATE["first"]:
        start()
    else:
        _WAITING.append(start)


def first_ended() -> None:
    """(tests/conftest.py, in the main thread between two tests) the first phase is over."""
    _STATE["ended"] = True
    while _WAITING:
        _WAITING.pop(0)()
