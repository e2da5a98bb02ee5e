"""Context parallelism on Hugging Face causal LMs fed the HF-Trainer way (a dict of input_ids and
labels, the loss computed by the model): SFT batches whose labels are -100 on a prompt prefix, on 2
and 4 gloo ranks (cp alone; with tp, whose vocab-sharded logits the loss check and the loss take; with
dp under ZeRO-3, whose all-gathers the loss check's forward runs too), train like one process (losses
rel 1e-4 over 3 steps, step-1 gradients, final parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from harness import Case, reference_for  # noqa: E402
from shared import result, share  # noqa: E402

pytestmark = pytest.mark.dist

SFT = Path(__file__).resolve().parent / "models" / "hf_qwen2_sft.py"


@dataclass(frozen=True, kw_only=True)
class SFTCase(Case):
    """A harness Case on the SFT model file (picklable: spawned workers import this module)."""

    def plan_dict(self) -> dict[str, Any]:
        par = {"dp": 1, "tp": 1, "pp": 1, **self.parallel}
        return {
            "version": 1,
            "model": {"file": str(SFT), "num_blocks": 4},
            "cluster": {"profile": "a100-80g", "num_gpus": par["dp"] * par["tp"] * par["pp"] * par.get("cp", 1), "gpus_per_node": 8},
            "training": {"global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
                         "seq_len": 32, "dtype": "fp32", "optimizer": "adamw"},
            "parallel": par,
        }


CASES = {
    2: [SFTCase(name="sft-cp2-ring", model="sft", parallel={"cp": 2, "cp_kind": "ring"}),
        SFTCase(name="sft-cp2-ulysses-mb2", model="sft", parallel={"cp": 2, "cp_kind": "ulysses"},
                micro_batch_size=2)],
    4: [SFTCase(name="sft-tp2xcp2", model="sft", parallel={"tp": 2, "cp": 2, "cp_kind": "ring"}),
        SFTCase(name="sft-dp2xcp2-zero3", model="sft", parallel={"dp": 2, "cp": 2, "cp_kind": "allgather", "zero": 3})],
}
for _world, _cases in CASES.items():
    share(_world, _cases)


@pytest.mark.parametrize(("world", "case"), [(w, c) for w, cs in CASES.items() for c in cs],
                         ids=lambda v: v.name if isinstance(v, SFTCase) else f"{v}ranks")
def test_sft_labels_train_like_one_process_under_cp(world: int, case: SFTCase) -> None:
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    spec = model_spec(load_model_file(SFT))
    assert (spec.token_key, spec.labels_key) == ("input_ids", "labels")
    assert spec.support_reason("cp") is None
    got = result(world, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, ref_params, ref_grads = reference_for(case)
    assert len(got["losses"]) == len(ref_losses) == 3
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: loss {a} vs reference {b}"
    for name, ref in ref_grads.items():
        tol = 1e-4 * float(ref.abs().max()) + 1e-7
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-3, atol=tol, msg=lambda m: f"grad {name}: {m}")
    for name, ref in ref_params.items():
        torch.testing.assert_close(got["params"][name], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
