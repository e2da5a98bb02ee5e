"""A plan runs from any directory: ``autopar plan`` writes a model path given relative to the working
directory relative to the plan's own directory (absolute past two levels up), and a plan's ``model.file`` is looked up beside the
plan first (plans written before, relative to where ``plan`` ran, are still found from there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.plan import model_path, portable_model_path


def test_the_model_path_is_written_from_the_plans_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.py").write_text("# a model file\n")
    monkeypatch.chdir(tmp_path)
    plan_path = tmp_path / "plans" / "p.yaml"
    plan_path.parent.mkdir()
    plan_path.write_text("# the plan\n")
    written = portable_model_path("models/m.py", plan_path)
    assert written == "../models/m.py"
    for cwd in (tmp_path, tmp_path / "models", tmp_path.parent):  # run from anywhere
        monkeypatch.chdir(cwd)
        found = Path(model_path(written, plan_path))
        assert found.resolve() == (tmp_path / "models" / "m.py").resolve(), cwd
    monkeypatch.chdir(tmp_path)
    far = tmp_path / "a" / "b" / "c" / "p.yaml"  # three levels up: absolute instead
    assert portable_model_path("models/m.py", far) == str((tmp_path / "models" / "m.py").resolve())
    assert portable_model_path("/abs/m.py", plan_path) == "/abs/m.py"


def test_an_older_plan_relative_to_where_plan_ran_is_still_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.py").write_text("# a model file\n")
    monkeypatch.chdir(tmp_path)
    assert model_path("models/m.py", tmp_path / "plans" / "p.yaml") == "models/m.py"
    assert model_path("/abs/m.py", tmp_path / "p.yaml") == "/abs/m.py"
