"""benchmarks/gpu_acceptance.py, the one-GPU acceptance run, works before a GPU's minutes are spent
on it: its dry run (--device cpu) runs every check's code path on CPU ranks, and none fails. The
test's dry run is --quick: the same steps on gpt_small's GPT at its tiny size (the script's code is
what is under test; a dry run's figures mean nothing either way), two checks at a time (--jobs 2: each
check's commands are processes of their own, most of the time is their start)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "acceptance.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_acceptance.py"), "--device", "cpu",
                           "--quick", "--jobs", "2", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    assert [c["check"] for c in checks] == list(range(1, 15))
    assert all(c["status"] in ("PASS", "INFO") for c in checks), checks
    by = {c["check"]: c for c in checks}
    assert "gloo:all_reduce" in by[2]["measured"]  # the recorder read back
    assert "first losses" in by[4]["measured"] and "exit 3" in by[10]["measured"]
    assert all(f"{kind} " in by[13]["measured"] for kind in ("gemm", "attention", "element-wise"))
    assert "bfloat16" in by[14]["measured"] and "float32" in by[14]["measured"]
