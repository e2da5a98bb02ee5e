"""autopar plan --engine, export --to and estimate --from as a user runs them: the plan's prediction
comes back from the engine's file. The plan runs ``python -m autopar`` as a subprocess; the export and
the estimate run in children forked off the warm CLI server (``run_cli_forked``, tests/cli/cli_server.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def test_cli_plan_export_estimate_from_round_trip(run_cli, run_cli_forked, tmp_path: Path) -> None:  # noqa: ANN001
    model = REPO / "tests" / "data" / "models" / "gpt12.py"
    plan = tmp_path / "p.yaml"
    out = run_cli("plan", model, "--gpus", "8", "--global-batch", "16", "--engine", "megatron", "--cluster", "h100-80g",
              "--quiet", "-o", plan)
    assert out.returncode == 0, out.stderr
    assert f"autopar export {plan} --to megatron" in out.stdout
    flags = tmp_path / "p.args"
    assert run_cli_forked("export", plan, "--to", "megatron", "-o", flags).returncode == 0
    got = run_cli_forked("estimate", model, "--from", "megatron", str(flags), "--json")
    assert got.returncode == 0, got.stderr
    predicted = json.loads(got.stdout)
    saved = yaml.safe_load(plan.read_text())["prediction"]
    assert predicted["step_time_s"] == pytest.approx(saved["step_time_s"], rel=1e-3)
    assert predicted["imported"]["engine"] == "megatron" and predicted["imported"]["plan"]["parallel"]
