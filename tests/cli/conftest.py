"""Helpers of the CLI tests: run ``python -m autopar`` in a subprocess from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("AUTOPAR_PROFILES", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess]:
    """run_cli(*args, cwd=REPO, one_core=False) -> CompletedProcess with text stdout/stderr.
    ``one_core``: the command sees one core (Linux), so a CPU profile's contention curve starts one
    helper rank rather than one per level up to twice the machine's cores."""

    def run(*args: str, cwd: Path = REPO, timeout: float = 120, one_core: bool = False) -> subprocess.CompletedProcess:
        env = _cli_env()
        pin = None
        if one_core and hasattr(os, "sched_setaffinity"):
            core = min(os.sched_getaffinity(0))
            pin = lambda: os.sched_setaffinity(0, {core})  # noqa: E731
        return subprocess.run([sys.executable, "-m", "autopar", *map(str, args)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout, preexec_fn=pin)

    return run


@pytest.fixture(scope="session")
def run_cli_forked() -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """run_cli_forked(*args, cwd=REPO, timeout=120, one_core=False) -> CompletedProcess, as ``run_cli`` returns, from a
    child forked off one warm server that imported torch and autopar once (cli_server.py): for the
    bad-input tables, whose rows are each a process start and a one-line refusal. The environment is
    ``run_cli``'s; rows that need an environment, a umask or a core of their own use ``run_cli``."""
    from cli_server import CliServer

    server = CliServer(_cli_env(), REPO)

    def run(*args: object, cwd: Path = REPO, timeout: float = 120, one_core: bool = False) -> subprocess.CompletedProcess:
        cpus = [min(os.sched_getaffinity(0))] if one_core and hasattr(os, "sched_getaffinity") else None
        return server.run(*args, cwd=cwd, timeout=timeout, cpus=cpus)

    yield run
    server.close()
