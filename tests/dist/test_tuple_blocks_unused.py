"""Two mechanisms on one small model (tests/dist/models/tuple_blocks_unused.py), each a case of 2
gloo ranks against one process:

- dp 2 (DDP) with a parameter the loss never reaches: DDP is told to find unused parameters exactly
  when the meta pass of spec/unused.py finds some (else its reducer never reduces the bucket that
  holds it, and the next step stops with "Expected to have finished reduction");
- pp 2 with blocks that return a one-element tuple ``(h,)``: the stand-ins of earlier stages' blocks
  answer a tuple too (a bare tensor's ``[0]`` is batch row 0, which a block reading ``b, s, d`` rejects).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
from harness import HERE, Case, reference_for, spawn_cases

pytestmark = pytest.mark.dist

FILE = HERE / "models" / "tuple_blocks_unused.py"


@dataclass(frozen=True, kw_only=True)
class FileCase(Case):
    """A harness Case on this test's model file (picklable: spawned workers import this module)."""

    def plan_dict(self) -> dict[str, Any]:
        par = {"dp": 1, "tp": 1, "pp": 1, **self.parallel}
        return {
            "version": 1,
            "model": {"file": str(FILE), "num_blocks": 4},
            "cluster": {"profile": "a100-80g", "num_gpus": par["dp"] * par["pp"], "gpus_per_node": 8},
            "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 16, "dtype": "fp32",
                         "optimizer": "adamw"},
            "parallel": par,
        }


CASES = [FileCase(name="unused-dp2", model="tuple-unused", parallel={"dp": 2}),
         FileCase(name="tuple-pp2", model="tuple-unused", parallel={"pp": 2})]


@functools.lru_cache(maxsize=None)
def _results() -> dict:
    return spawn_cases(2, CASES)


def test_the_meta_pass_names_the_parameter_the_loss_never_reaches() -> None:
    from autopar.modelfile import load_model_file
    from autopar.spec.unused import parameters_without_grad

    assert parameters_without_grad(load_model_file(FILE)) == ("mask_token",)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_trains_like_one_rank(case: FileCase) -> None:
    got = _results()[case.name]
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, _, _ = reference_for(case)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-4)
