"""Mechanisms found on architectures the zoo had not seen, each on a small model of its own and run
on 2 gloo ranks against one process (in the session's 2-rank spawn, tests/dist/shared.py):

- a per-channel layer scale in a module of its own runs under Megatron sequence parallelism like a
  norm (spec/sp_check.is_norm; tests/dist/models/layer_scale.py, HF DINOv2's pattern): SP is offered
  (before: "gamma is in neither a tensor-parallel layer nor a norm"), and tp 2 + SP trains like one
  process -- the scale's gradient, computed on each rank's sequence shard, is summed;
- dp 2 (DDP) with a parameter the loss never reaches (tests/dist/models/tuple_blocks_unused.py):
  DDP is told to find unused parameters exactly when the meta pass of spec/unused.py finds some
  (else its reducer never reduces the bucket that holds it, and the next step stops with "Expected
  to have finished reduction");
- pp 2 with blocks that return a one-element tuple ``(h,)`` (same model): the stand-ins of earlier
  stages' blocks answer a tuple too (a bare tensor's ``[0]`` is batch row 0);
- experts that a rank's tokens did not choose get no gradient there (tests/dist/models/skipped_experts.py,
  HF Switch Transformers' pattern): ZeRO-3 (FSDP2) and DDP train like one process. The spec notes the
  router (spec.routed); DDP then finds unused parameters each step, and FSDP2's ranks agree on the
  parameters to reduce (executor/parallel/routed_grads.py) -- without it their reduce-scatters differ
  in size and gloo aborts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from harness import HERE, Case, reference_for
from shared import result, share

pytestmark = pytest.mark.dist

# model -> (file, blocks, sequence)
FILES = {
    "layer-scale": (HERE / "models" / "layer_scale.py", 4, 16),
    "tuple-unused": (HERE / "models" / "tuple_blocks_unused.py", 4, 16),
    "skipped": (HERE / "models" / "skipped_experts.py", 2, 8),
}


@dataclass(frozen=True, kw_only=True)
class FileCase(Case):
    """A harness Case on one of FILES (picklable: spawned workers import this module)."""

    def plan_dict(self) -> dict[str, Any]:
        path, blocks, seq = FILES[self.model]
        par = {"dp": 1, "tp": 1, "pp": 1, **self.parallel}
        return {
            "version": 1,
            "model": {"file": str(path), "num_blocks": blocks},
            "cluster": {"profile": "a100-80g", "num_gpus": par["dp"] * par["tp"] * par["pp"], "gpus_per_node": 8},
            "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": seq, "dtype": "fp32",
                         "optimizer": "adamw"},
            "parallel": par,
        }


CASES = share(2, [
    FileCase(name="layer-scale-tp2-sp", model="layer-scale", parallel={"tp": 2, "sequence_parallel": True}),
    FileCase(name="unused-dp2", model="tuple-unused", parallel={"dp": 2}),
    FileCase(name="tuple-pp2", model="tuple-unused", parallel={"pp": 2}),
    FileCase(name="skipped-zero3", model="skipped", parallel={"dp": 2, "zero": 3}),
    FileCase(name="skipped-ddp", model="skipped", parallel={"dp": 2}),
])


def _spec(model: str):
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    return model_spec(load_model_file(FILES[model][0]))


def test_sp_is_offered_past_a_layer_scale() -> None:
    assert _spec("layer-scale").support["sp"] is None


def test_the_meta_pass_names_the_parameter_the_loss_never_reaches() -> None:
    from autopar.modelfile import load_model_file
    from autopar.spec.unused import parameters_without_grad

    assert parameters_without_grad(load_model_file(FILES["tuple-unused"][0])) == ("mask_token",)


def test_the_spec_notes_the_router() -> None:
    assert _spec("skipped").routed


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_trains_like_one_rank(case: FileCase) -> None:
    got = result(2, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, ref_params, _ = reference_for(case)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-4)
    if case.model == "layer-scale":  # the scale's gradient summed over the sequence shards
        for name in ("blocks.0.scale.gamma", "blocks.3.scale.gamma"):
            assert torch.allclose(got["params"][name], ref_params[name], rtol=1e-4, atol=1e-6), name
