"""A per-channel layer scale in a module of its own runs under Megatron sequence parallelism like a
norm (spec/sp_check.is_norm): SP is offered for tests/dist/models/layer_scale.py (before: "gamma is in
neither a tensor-parallel layer nor a norm", as for HF DINOv2), and tp 2 + SP on 2 gloo ranks trains
like one process -- the scale's gradient, computed on each rank's sequence shard, is summed."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
from harness import HERE, Case, reference_for, spawn_cases

pytestmark = pytest.mark.dist

FILE = HERE / "models" / "layer_scale.py"


@dataclass(frozen=True, kw_only=True)
class FileCase(Case):
    """A harness Case on this test's model file (picklable: spawned workers import this module)."""

    def plan_dict(self) -> dict[str, Any]:
        par = {"dp": 1, "tp": 1, "pp": 1, **self.parallel}
        return {
            "version": 1,
            "model": {"file": str(FILE), "num_blocks": 4},
            "cluster": {"profile": "a100-80g", "num_gpus": par["tp"], "gpus_per_node": 8},
            "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 16, "dtype": "fp32",
                         "optimizer": "adamw"},
            "parallel": par,
        }


CASE = FileCase(name="layer-scale-tp2-sp", model="layer-scale", parallel={"tp": 2, "sequence_parallel": True})


@functools.lru_cache(maxsize=None)
def _results() -> dict:
    return spawn_cases(2, [CASE])


def test_sp_is_offered() -> None:
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    assert model_spec(load_model_file(FILE)).support["sp"] is None


def test_tp2_sp_trains_like_one_rank() -> None:
    got = _results()[CASE.name]
    assert isinstance(got, dict), f"{CASE.name} failed:\n{got}"
    ref_losses, ref_params, _ = reference_for(CASE)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-4)
    for name in ("blocks.0.scale.gamma", "blocks.3.scale.gamma"):
        assert torch_close(got["params"][name], ref_params[name]), name


def torch_close(a, b) -> bool:
    import torch

    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)
