"""Bad input through the command line: exit code 2, one line on stderr starting with 'autopar: error:'
(or 'autopar estimate: error:' for argument errors), nothing on stdout, never a traceback.

The rows run in children forked off one warm process that imported torch and autopar once
(``run_cli_forked``, tests/cli/cli_server.py), but those of ``SUBPROCESS`` and the tests below the
table, which run ``python -m autopar`` in a subprocess of their own (the entry point end to end)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from plan_data import GOOD, GPT12, MODELS


def _plan(tmp_path: Path, name: str = "plan.yaml", **sections: dict) -> Path:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in GOOD.items()}
    for section, changes in sections.items():
        data[section] = {**data[section], **changes} if isinstance(changes, dict) else changes
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _check_one_line_error(res, *needles: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    assert res.stdout == ""
    lines = res.stderr.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {res.stderr!r}"
    line = lines[0]
    assert line.startswith(("autopar: error:", "autopar estimate: error:")), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def test_good_plan_runs(run_cli, tmp_path: Path) -> None:
    """The fixture the bad cases mutate is itself valid."""
    res = run_cli("estimate", GPT12, _plan(tmp_path), "--json")
    assert res.returncode == 0, res.stderr


# Each case: (id, function(tmp_path) -> argv, substrings the error line must contain)
CASES = [
    ("missing-plan-file", lambda t: ["estimate", GPT12, t / "nope.yaml"], ["nope.yaml", "does not exist"]),
    ("malformed-yaml", lambda t: ["estimate", GPT12, _write(t, "bad.yaml", "version: 1\nmodel: {file: x.py\n")],
     ["bad.yaml", "not valid YAML"]),
    ("unknown-key", lambda t: ["estimate", GPT12, _plan(t, parallel={"pipeline": 2})], ["parallel.pipeline"]),
    ("wrong-type", lambda t: ["estimate", GPT12, _plan(t, parallel={"tp": "four"})], ["parallel.tp"]),
    ("python-tag", lambda t: ["estimate", GPT12, _write(t, "tag.yaml", "!!python/object/apply:os.getcwd []\n")],
     ["python/object"]),
    ("degrees-do-not-multiply", lambda t: ["estimate", GPT12, _plan(t, parallel={"dp": 4})], ["cluster.num_gpus"]),
    ("tp-does-not-divide-heads",
     lambda t: ["estimate", GPT12, _plan(t, parallel={"dp": 1, "tp": 8})], ["parallel.tp", "12 attention heads"]),
    ("block-count-differs", lambda t: ["estimate", GPT12, _plan(t, model={"num_blocks": 6})], ["6 blocks", "4"]),
    ("missing-model-file", lambda t: ["estimate", t / "nomodel.py", _plan(t)], ["nomodel.py", "does not exist"]),
    ("model-import-error", lambda t: ["estimate", MODELS / "import_error.py", _plan(t)],
     ["import_error.py", "autopar_no_such_module_xyz"]),
    ("model-exits-at-import", lambda t: ["estimate", MODELS / "exits_at_import.py", _plan(t)],
     ["exits_at_import.py", "exit(3)"]),
    ("model-without-build-model", lambda t: ["estimate", MODELS / "no_build_model.py", _plan(t)],
     ["no_build_model.py", "build_model"]),
    ("model-fails-on-meta", lambda t: ["estimate", MODELS / "forward_fails_on_meta.py", _plan(t, model={"num_blocks": 2})],
     ["forward_fails_on_meta.py", "meta"]),
    ("unknown-cluster", lambda t: ["estimate", GPT12, _plan(t), "--cluster", "tpu-v5"], ["tpu-v5", "a100-80g"]),
    ("cluster-file-missing", lambda t: ["estimate", GPT12, _plan(t), "--cluster", t / "none.yaml"], ["none.yaml"]),
    ("cluster-file-malformed",
     lambda t: ["estimate", GPT12, _plan(t), "--cluster", _write(t, "c.yaml", "gpu: {name: X}\nnetwork: {}\n")],
     ["c.yaml"]),
    ("plan-seq-longer-than-model", lambda t: ["estimate", GPT12, _plan(t, training={"seq_len": 128})], ["128"]),
    ("unknown-option", lambda t: ["estimate", GPT12, _plan(t), "--bogus"], ["--bogus"]),
    ("missing-plan-argument", lambda t: ["estimate"], ["PLAN.yaml"]),
    ("unknown-command", lambda t: ["estimat"], ["estimat"]),
    ("no-command", lambda t: [], ["COMMAND"]),
]


# A real ``python -m autopar`` subprocess for these rows: a model file that fails at import, one that
# exits at import, and the parser's refusal of an unknown command.
SUBPROCESS = {"model-import-error", "model-exits-at-import", "unknown-command"}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_at_least_ten_kinds() -> None:
    assert len(CASES) >= 10
    assert SUBPROCESS <= {c[0] for c in CASES}


@pytest.mark.parametrize("name,make_args,needles", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_one_line_error(run_cli, run_cli_forked, tmp_path: Path, name: str, make_args,
                                       needles: list[str]) -> None:
    res = (run_cli if name in SUBPROCESS else run_cli_forked)(*make_args(tmp_path))
    _check_one_line_error(res, *needles)


def test_bad_plan_with_relative_paths_from_another_directory(run_cli, tmp_path: Path, repo: Path) -> None:
    """Errors name the path as the user typed it, wherever autopar runs from."""
    (tmp_path / "plans").mkdir()
    path = _plan(tmp_path / "plans", parallel={"zero": 7})
    res = run_cli("estimate", GPT12, "plans/plan.yaml", cwd=tmp_path)
    _check_one_line_error(res, "plans/plan.yaml", "parallel.zero")
    assert path.is_file()
