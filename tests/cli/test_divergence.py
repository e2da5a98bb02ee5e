"""A diverging run stops: ``--lr 30`` drove a loss from 4.9 to 30,000 in one step and the run used to
exit 0 without a word. A step's loss above ``--max-loss-ratio`` (default 10) times the first stops
the run with one line, exit 2, the last good checkpoint kept; 0 never stops."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from autopar.errors import AutoparError
from autopar.executor.runtime.rank_main import DivergedLoss, check_divergence
from autopar.executor.runtime.run_options import RunOptions

REPO = Path(__file__).resolve().parents[2]
PLAN = {"version": 1, "model": {"file": str(REPO / "tests" / "dist" / "models" / "tiny_gpt.py"), "num_blocks": 4},
        "cluster": {"profile": "a100-80g", "num_gpus": 1, "gpus_per_node": 8},
        "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 32, "dtype": "fp32"},
        "parallel": {"dp": 1, "tp": 1, "pp": 1}}


def test_a_diverging_run_stops_with_one_line(run_cli, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(PLAN))
    res = run_cli("run", plan, "--steps", "6", "--lr", "30", "--report", tmp_path / "r.json")
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "training diverged" in errors[0] and "--max-loss-ratio" in errors[0], res.stderr
    assert "Traceback" not in res.stderr


def test_the_check_itself() -> None:
    check_divergence(2, 40.0, 5.0, 10.0, "kept")  # 8x: goes on
    check_divergence(2, 1e6, 5.0, 0.0, "kept")  # 0: never stops
    check_divergence(2, 1e6, None, 10.0, "kept")  # the first step: nothing to compare
    check_divergence(2, 1e6, -3.0, 10.0, "kept")  # a loss that is not positive: no ratio
    with pytest.raises(DivergedLoss, match=r"step 3 is 60, more than 10x the first step's 5"):
        check_divergence(3, 60.0, 5.0, 10.0, "kept")
    for bad in (1.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(AutoparError, match="--max-loss-ratio"):
            RunOptions(plan_path="p.yaml", max_loss_ratio=bad)
