"""Experts that a rank's tokens did not choose get no gradient there (tests/dist/models/skipped_experts.py,
HF Switch Transformers' pattern): ZeRO-3 (FSDP2) and DDP over 2 gloo ranks train like one process.
The spec notes the router (spec.routed); DDP then finds unused parameters each step, and FSDP2's
ranks agree on the parameters to reduce (executor/parallel/routed_grads.py) -- without it their
reduce-scatters differ in size and gloo aborts."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
from harness import HERE, Case, reference_for, spawn_cases

pytestmark = pytest.mark.dist

FILE = HERE / "models" / "skipped_experts.py"


@dataclass(frozen=True, kw_only=True)
class FileCase(Case):
    """A harness Case on this test's model file (picklable: spawned workers import this module)."""

    def plan_dict(self) -> dict[str, Any]:
        par = {"dp": 1, "tp": 1, "pp": 1, **self.parallel}
        return {
            "version": 1,
            "model": {"file": str(FILE), "num_blocks": 2},
            "cluster": {"profile": "a100-80g", "num_gpus": par["dp"], "gpus_per_node": 8},
            "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 8, "dtype": "fp32",
                         "optimizer": "adamw"},
            "parallel": par,
        }


CASES = [FileCase(name="skipped-zero3", model="skipped", parallel={"dp": 2, "zero": 3}),
         FileCase(name="skipped-ddp", model="skipped", parallel={"dp": 2})]


@functools.lru_cache(maxsize=None)
def _results() -> dict:
    return spawn_cases(2, CASES)


def test_the_spec_notes_the_router() -> None:
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    assert model_spec(load_model_file(FILE)).routed


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_trains_like_one_rank(case: FileCase) -> None:
    got = _results()[case.name]
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, _, _ = reference_for(case)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-4)
