"""pytest set-up of the zoo tests: once the session's collection ends, the models of the selected run
cases are prepared ahead (test_zoo.prepared_ahead, test_zoo._prepare: each model's support probe and
one-rank reference, one child) in a thread, one child at a time, while the tests collected before the
zoo's run; each run case waits for its own model's answer (test_zoo.AHEAD)."""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_STARTED: list[tuple[ThreadPoolExecutor, str]] = []


def pytest_collection_finish(session) -> None:  # noqa: ANN001
    if session.config.option.collectonly:
        return
    zoo = [item for item in session.items if getattr(getattr(item, "module", None), "__name__", "") == "test_zoo"]
    if not zoo:
        return
    module = zoo[0].module
    names = module.prepared_ahead(zoo)
    if not names:
        return
    pool, root = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zoo-prepare"), tempfile.mkdtemp(prefix="autopar-zoo-")
    _STARTED.append((pool, root))
    env = dict(os.environ)  # now: a test running beside a child may set variables of its own
    for name in names:
        (Path(root) / name).mkdir()
        module.AHEAD[name] = pool.submit(module._prepare, name, Path(root) / name, env)


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001
    for pool, root in _STARTED:
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(root, ignore_errors=True)
