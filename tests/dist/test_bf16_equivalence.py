"""bf16 end to end on gloo (GPU readiness, M2): every data-parallel kind the executor wraps with
(none under a pipeline, DDP, ZeRO-1 and ZeRO-3 over FSDP2) and tensor, context and pipeline
parallelism train a bf16 plan on 2 CPU ranks as the single-process bf16 run does -- the paths the
fp32 suite never runs: autocast, FSDP2's mixed-precision policy, the pipeline's bf16 receive
buffers, context parallelism's attention pieces in bf16, reductions of bf16 tensors on gloo.

Tolerances are bf16's, not fp32's: the single-process reference trains under autocast (fp32
parameters, bf16 matmuls) while FSDP2 computes on bf16 parameters, so losses agree to 0.2 % and the
first step's gradients in direction (cosine >= 0.999) and size (norms within 2 %): about 10x the
differences measured (worst: loss 6e-5, cosine 0.99990, norm 0.3 %, ZeRO-1), and sharp enough for a
missing or doubled 1/dp, 1/cp or 1/micro-batch factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from harness import Case, reference_for
from shared import result, share

pytestmark = pytest.mark.dist


@dataclass(frozen=True, kw_only=True)
class BF16Case(Case):
    """A Case trained in bf16 (its reference too: reference_for keys on the plan's training section)."""

    def plan_dict(self) -> dict[str, Any]:
        d = super().plan_dict()
        d["training"]["dtype"] = "bf16"
        return d


CASES = share(2, [
    BF16Case(name="bf16-ddp", model="gpt", parallel={"dp": 2, "zero": 0}),
    BF16Case(name="bf16-zero1", model="gpt", parallel={"dp": 2, "zero": 1}),
    BF16Case(name="bf16-zero3", model="llama", parallel={"dp": 2, "zero": 3}),
    BF16Case(name="bf16-tp2-sp", model="llama", parallel={"tp": 2, "sequence_parallel": True}),
    BF16Case(name="bf16-cp2-ring", model="llama", parallel={"cp": 2, "cp_kind": "ring"}),
    BF16Case(name="bf16-pp2-1f1b", model="gpt", parallel={"pp": 2, "pp_schedule": "1f1b"}),
])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_plan_trains_as_one_process(case: BF16Case) -> None:
    got = result(2, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, _, ref_grads = reference_for(case)
    assert len(got["losses"]) == len(ref_losses)
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert torch.isfinite(torch.tensor(a)), f"step {step}: loss {a}"
        assert a == pytest.approx(b, rel=2e-3), f"step {step}: loss {a} vs reference {b}"
    assert set(ref_grads) <= set(got["grads"]), sorted(set(ref_grads) - set(got["grads"]))
    for name, ref in ref_grads.items():
        g, r = got["grads"][name].float().flatten(), ref.float().flatten()
        if float(r.norm()) < 1e-6:
            continue
        cos = float(torch.nn.functional.cosine_similarity(g, r, dim=0))
        ratio = float(g.norm() / r.norm())
        assert cos >= 0.999 and abs(ratio - 1) <= 0.02, f"grad {name}: cosine {cos:.4f}, norm ratio {ratio:.4f}"
