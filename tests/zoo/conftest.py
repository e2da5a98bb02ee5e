"""pytest set-up of the zoo tests: once the session's collection ends, the models of the selected run
cases are prepared ahead (test_zoo.prepared_ahead, test_zoo._prepare: each model's support probe and
one-rank reference, one child), then the selected cases' 2-rank run cells are run ahead, one at a time
in a thread, in one helper process (zoo_ahead.py), while the tests collected before the zoo's run
(tests/unit first: one process, a core idle). Each run case waits for its own model's answer
(test_zoo.AHEAD) and its own cell's (zoo_ahead.run_cell_ahead)."""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zoo_ahead

_STARTED: list[tuple[ThreadPoolExecutor, zoo_ahead.Lane, str]] = []
_PATCHED: list[Any] = []  # zoo_lib, whose run_cell zoo_ahead stands in for during the session


def _run_cases(items: list, names: list[str]) -> list[tuple[str, str]]:
    """(model, dimension) of the selected run cases of the models prepared ahead, in test order."""
    cases: list[tuple[str, str]] = []
    for item in items:
        spec = getattr(item, "callspec", None)
        if getattr(item, "originalname", None) == "test_zoo_model_trains_like_one_rank" and spec is not None:
            case = (spec.params["name"], spec.params["dim"])
            if case[0] in names and case not in cases:
                cases.append(case)
    return cases


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
    root = tempfile.mkdtemp(prefix="autopar-zoo-")
    # now: a test running beside the lane may set variables of its own
    pool, lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zoo-ahead"), zoo_ahead.Lane(dict(os.environ))
    _STARTED.append((pool, lane, root))
    for name in names:
        (Path(root) / name).mkdir()
        module.AHEAD[name] = pool.submit(zoo_ahead.prepare, lane, module._prepare, name, Path(root) / name)
    zoo_lib = module.zoo_lib
    zoo_ahead.install(zoo_lib)
    _PATCHED.append(zoo_lib)
    for name, dim in _run_cases(zoo, names):
        tiny = Path(root) / name / zoo_lib.zoo_models([name])[0].path.name  # where _prepare writes it
        zoo_ahead.keep(tiny, dim, pool.submit(zoo_ahead.run_after, lane, module.AHEAD[name], dim))


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001
    for pool, lane, root in _STARTED:
        pool.shutdown(wait=True, cancel_futures=True)
        lane.close()
        shutil.rmtree(root, ignore_errors=True)
    for zoo_lib in _PATCHED:
        zoo_ahead.uninstall(zoo_lib)
