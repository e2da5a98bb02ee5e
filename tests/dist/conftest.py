"""pytest set-up of the distributed tests: spawned workers import `harness` by name, so its folder
leads sys.path. Shared helpers live in harness.py, never here: a worker that imports `conftest`
may find tests/unit/conftest.py first, depending on the order pytest collected the folders."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so spawned workers can import harness


def pytest_collection_finish(session) -> None:  # noqa: ANN001
    """The session's shared spawns run only what the selected tests use, and start in a thread
    (tests/dist/shared.py) once tests/unit, which runs first, is over (tests/session_phases.py): now
    when it is not selected."""
    import session_phases
    import shared

    shared.select(session.items)
    if not session.config.option.collectonly:
        session_phases.after_first(shared.start_ahead)


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001
    import shared

    shared.stop_ahead()
