"""TP on models autopar did not write, with nothing declared: HF GPT-2 (Conv1D, fused c_attn split by
a fixed ``split_size``) and a decoder with its own module names (fused key/value projection), each at
tp = 2 with and without sequence parallelism, against one rank; and autopar's GPT with a tp_plan
written as HF writes one (``layers.*.attn.qkv``); a decoder whose fused projections only the data
flow can count (tests/dist/models/fused_chunks.py). In the session's 2-rank spawn (tests/dist/shared.py).

The plans come from the data flow (autopar.spec.tp_infer); the executor shards Conv1D with
autopar.executor.parallel.tp_conv1d. fp32: losses within rel 1e-4, gradients and parameters as in
test_equivalence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from harness import HERE, ZOO, Case, reference_for
from shared import result, share

pytestmark = pytest.mark.dist

FILES = {"hf-gpt2": ZOO / "hf_gpt2.py", "odd-names": ZOO / "odd_names_decoder.py",
         "gpt-hf-patterns": HERE / "models" / "tiny_gpt_hf_patterns.py",
         "fused-chunks": HERE / "models" / "fused_chunks.py"}
LAYERS = {"hf-gpt2": 4, "odd-names": 4, "gpt-hf-patterns": 4, "fused-chunks": 2}
SEQ = {"fused-chunks": 16}


@dataclass(frozen=True, kw_only=True)
class ForeignCase(Case):
    """A Case on one of this module's model files (the harness's MODELS are autopar's own)."""

    def plan_dict(self) -> dict[str, Any]:
        return _plan_dict(self)


def _plan_dict(case: Case) -> dict[str, Any]:
    par = {"dp": 1, "tp": 1, "pp": 1, **case.parallel}
    return {
        "version": 1,
        "model": {"file": str(FILES[case.model]), "num_blocks": LAYERS[case.model]},
        "cluster": {"profile": "a100-80g", "num_gpus": par["dp"] * par["tp"] * par["pp"], "gpus_per_node": 8},
        "training": {"global_batch_size": case.global_batch_size, "micro_batch_size": case.micro_batch_size,
                     "seq_len": SEQ.get(case.model, 32), "dtype": "fp32", "optimizer": "adamw"},
        "parallel": par,
    }


CASES = share(2, [
    ForeignCase(name="hf-gpt2-tp2", model="hf-gpt2", parallel={"tp": 2}),
    ForeignCase(name="hf-gpt2-tp2-sp", model="hf-gpt2", parallel={"tp": 2, "sequence_parallel": True}),
    # fused q/k/v and gate/up split by chunk, column and row layers in different modules
    ForeignCase(name="fused-chunks-tp2", model="fused-chunks", parallel={"tp": 2}),
    # a declared plan in Hugging Face's form (layers.*.x): the executor reads what the planner read
    ForeignCase(name="gpt-hf-patterns-tp2", model="gpt-hf-patterns", parallel={"tp": 2}),
    ForeignCase(name="odd-names-tp2", model="odd-names", parallel={"tp": 2}),
    ForeignCase(name="odd-names-tp2-sp", model="odd-names", parallel={"tp": 2, "sequence_parallel": True}),
])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_foreign_model_tp2_matches_one_rank(case: ForeignCase) -> None:
    pytest.importorskip("transformers")
    got = result(2, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, ref_params, ref_grads = reference_for(case)
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: loss {a} vs reference {b}"
    assert got["vocab_sharded"], "the vocabulary edges should be sharded at tp = 2"
    # every loss here (a vocabulary constant in a reshape included) runs on the vocab-sharded logits
    assert not any("all-gathered" in n for n in got["notes"]), got["notes"]
    for name, ref in ref_grads.items():
        tol = 1e-4 * float(ref.abs().max()) + 1e-7
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-3, atol=tol, msg=lambda m: f"grad {name}: {m}")
    for name, ref in ref_params.items():
        torch.testing.assert_close(got["params"][name], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
