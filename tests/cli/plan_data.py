"""Test data shared by the command-line bad-input tests: a model file and a plan that is valid
for it, which each test breaks one way."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "data" / "models"
GPT12 = MODELS / "gpt12.py"  # 4 blocks, 12 heads, seq 64

GOOD = {
    "version": 1,
    "model": {"file": str(GPT12), "num_blocks": 4},
    "cluster": {"profile": "a100-80g", "num_gpus": 8, "gpus_per_node": 8},
    "training": {"global_batch_size": 16, "micro_batch_size": 1, "seq_len": 64},
    "parallel": {"dp": 2, "tp": 4, "pp": 1},
}
