"""``autopar rehearse --why N``: each rank names the largest groups of tensors alive at its peak --
their part, the op that made them and the module it ran in (autopar.rehearse.why)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from autopar.commands.main import main

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"


def test_why_names_the_largest_groups_at_the_peak(tmp_path: Path, capsys) -> None:
    plan = {"version": 1, "model": {"file": str(ZOO / "torch_encoder.py"), "num_blocks": 4},
            "cluster": {"profile": "a100-80g", "num_gpus": 2, "gpus_per_node": 2},
            "training": {"global_batch_size": 8, "micro_batch_size": 4, "seq_len": 32, "dtype": "bf16",
                         "optimizer": "adamw"},
            "parallel": {"dp": 2, "tp": 1, "pp": 1, "zero": 1}}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan), encoding="utf-8")
    assert main(["rehearse", str(path), "--ranks", "0", "--workers", "1", "--quiet", "--why", "5", "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)["ranks"][0]
    groups = rank["live_at_peak"]
    assert 0 < len(groups) <= 5
    assert [g["nbytes"] for g in groups] == sorted((g["nbytes"] for g in groups), reverse=True)
    assert sum(g["nbytes"] for g in groups) <= rank["peak_bytes"]
    made = [g for g in groups if g["part"] == "activations"]
    assert made and all(g["op"].startswith("aten.") for g in made)
    assert any(".*." in g["module"] for g in made)  # block indices folded (layers.*.)
    assert main(["rehearse", str(path), "--ranks", "0", "--workers", "1", "--quiet", "--why", "3"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: the largest groups of tensors alive at its peak" in out and "made by" in out
