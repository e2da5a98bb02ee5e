"""Helpers of the CLI tests: run ``python -m autopar`` in a subprocess from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess]:
    """run_cli(*args, cwd=REPO) -> CompletedProcess with text stdout/stderr."""

    def run(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env.pop("AUTOPAR_PROFILES", None)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        return subprocess.run([sys.executable, "-m", "autopar", *map(str, args)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)

    return run
