"""A 16-bit layer profile measures the executor's regime (GPU readiness, M3): the one-block model cast
to bf16, as FSDP2's mixed-precision policy and the meta trace run it -- not autocast, whose per-forward
bf16 copy of every Linear weight was counted as the block's activations (2 bytes per block parameter
per micro-batch: more than double gpt_small's block at 128 tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def test_bf16_block_saved_bytes_match_the_trace(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from autopar.commands.main import main
    from autopar.graph.measure import build_graph
    from autopar.graph.model_graph import region_totals
    from autopar.graph.scaling import Shape

    model = str(REPO / "examples" / "gpt_small.py")
    out = tmp_path / "bf16.yaml"
    assert main(["profile", model, "--device", "cpu", "--dtype", "bf16", "--tp", "1", "--cp", "1",
                 "--micro-batch", "1", "--no-comm", "--load-ranks", "1", "--repeats", "1", "--warmup", "0",
                 "--no-kernels", "-o", str(out)]) == 0
    block = [p for p in yaml.safe_load(out.read_text())["measured"]["layers"]["block"]
             if p["b"] == 1 and p.get("tp", 1) == 1 and "cp" not in p]
    traced = region_totals(build_graph(model, dtype="bf16").regions["block"],
                           Shape(b=1, s_ratio=1.0, kv_ratio=1.0, t=1))["saved_bytes"]
    assert block[0]["saved_bytes"] == pytest.approx(traced, rel=0.10)
