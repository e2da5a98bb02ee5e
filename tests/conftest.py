"""Suite-wide set-up: the tests use a graph cache of their own (a fresh directory per session),
so that no result depends on what an earlier run, or the user's own plans, left in
~/.cache/autopar (a cached graph skips the model file's code: a test that expects the file's
prints or errors would pass or fail by the cache's state). Tests that exercise the cache's
location set XDG_CACHE_HOME themselves. Ranks train on the CPU (AUTOPAR_DEVICE=cpu) on any host."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE_DIR: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    _CACHE_DIR.append(tempfile.mkdtemp(prefix="autopar-test-cache-"))
    os.environ["XDG_CACHE_HOME"] = _CACHE_DIR[0]  # inherited by every subprocess and spawned rank
    # The suite trains on CPU ranks (gloo) even on a GPU host: `autopar run` would take CUDA there
    os.environ.setdefault("AUTOPAR_DEVICE", "cpu")


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _CACHE_DIR:
        shutil.rmtree(path, ignore_errors=True)
