"""``autopar profile`` on the simplest models a user writes: blocks that take the raw input (no
module before them, an empty ``pre`` region) and/or whose last output is the model's output (no
module after them, an empty ``post`` region). Every region of the layer table is measured, >= 0,
an empty one exactly 0, and ``autopar plan`` prices the model with that table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.modelfile import load_model_file
from autopar.profile_tables import LayerTable, measured_from_dict
from autopar.profiler.layers import LayerProfileConfig, profile_layers
from autopar.yamlload import load_yaml

HEAD = '''import torch, torch.nn as nn
SEQ_LEN = 16
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 8)
    def forward(self, x):
'''
PRE = "        x = self.inp(x)\n"
BLOCKS = "        for b in self.blocks:\n            x = b(x)\n"
POST = "        x = self.head(x)\n"
TAIL = '''        return x
def build_model(): return M()
def example_inputs(micro_batch_size): return torch.randn(micro_batch_size, SEQ_LEN, 8)
def loss_fn(out, inputs): return out.sum()
'''
# layout -> (has a pre region, has a post region); unused modules are never called
LAYOUTS = {"bare": (False, False), "pre-only": (True, False), "post-only": (False, True), "both": (True, True)}
# the smallest profile: one shape, one timed run, no sweeps, no helpers, no collectives
SMALL = ("--device", "cpu", "--micro-batch", "1", "--tp", "1", "--cp", "1", "--repeats", "1", "--warmup", "0",
         "--no-kernels", "--no-comm", "--load-ranks", "1")


def _model(tmp_path: Path, layout: str) -> Path:
    pre, post = LAYOUTS[layout]
    path = tmp_path / f"{layout.replace('-', '_')}.py"
    path.write_text(HEAD + (PRE if pre else "") + BLOCKS + (POST if post else "") + TAIL)
    return path


def _check(table: LayerTable, layout: str) -> None:
    """Every region has points, all >= 0; an absent edge is 0 in time and memory, a present one > 0."""
    pre, post = LAYOUTS[layout]
    assert set(table.regions) == {"pre", "block", "post", "loss"}  # the regions the planner looks up
    for region, points in table.regions.items():
        assert points, region
        present = {"pre": pre, "post": post}.get(region, True)
        for p in points:
            assert p.fwd_s >= 0 and p.bwd_s >= 0 and p.saved_bytes >= 0, (region, p)
            if present:
                assert p.fwd_s > 0 and p.bwd_s > 0, (region, p)
            else:
                assert p.fwd_s == 0 and p.bwd_s == 0 and p.saved_bytes == 0, (region, p)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_layer_table_of_blocks_without_a_pre_or_post_region(tmp_path: Path, layout: str) -> None:
    mf = load_model_file(_model(tmp_path, layout))
    cfg = LayerProfileConfig(micro_batches=(1, 2), tps=(1,), cps=(1, 2), warmup=0, repeats=1)
    _check(profile_layers(mf, torch.device("cpu"), cfg), layout)


# the CLI end to end on the layout with neither region (the others' tables: the test above)
def test_profile_then_plan_with_it(run_cli, tmp_path: Path) -> None:
    layout = "bare"
    model = _model(tmp_path, layout)
    profile, plan = tmp_path / "p.yaml", tmp_path / "plan.yaml"
    r = run_cli("profile", model, *SMALL, "-o", profile, cwd=tmp_path, timeout=300, one_core=True)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    table = measured_from_dict(load_yaml(profile.read_text(), str(profile))["measured"], str(profile)).layers
    assert table is not None
    _check(table, layout)
    r = run_cli("plan", model, "--gpus", "2", "--profile", profile, "-o", plan, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert plan.exists()
