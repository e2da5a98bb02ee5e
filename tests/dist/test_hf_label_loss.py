"""Hugging Face causal LMs trained through ``labels`` (``model(input_ids=..., labels=...)``,
``loss_fn`` returning ``output.loss``) under tensor parallelism train like one rank: the model's own
label loss views the logits by ``config.vocab_size`` and runs on the head's vocabulary-sharded
DTensor logits under ``loss_parallel()`` -- vocab-parallel, no gathered logits (no run note says
otherwise), the edges sharded by vocabulary.

- GLM-4: the model's HF plan marks its fused ``gate_up_proj`` with a style autopar does not run; the
  data flow's plan (checked whole) shards it, so Megatron SP is offered and runs.
- Cohere: logits scaled inside the model before its loss; parallel attention and MLP under SP.
- MPT: attention through a per-head ALiBi bias built outside the blocks keeps attention replicated
  (no SP), its MLP tensor-parallel.

The session's spawn of 2 gloo ranks runs the three cases (tests/dist/shared.py), tiny configs of the zoo's files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("transformers")

from harness import ZOO, Case, reference_for  # noqa: E402
from shared import result, share  # noqa: E402

pytestmark = pytest.mark.dist

FILES = {"hf-glm4": ZOO / "hf_glm4.py", "hf-cohere": ZOO / "hf_cohere.py", "hf-mpt": ZOO / "hf_mpt.py"}


@dataclass(frozen=True, kw_only=True)
class LabelCase(Case):
    """A harness Case on a zoo file (picklable: spawned workers import this module)."""

    def plan_dict(self) -> dict[str, Any]:
        par = {"dp": 1, "tp": 1, "pp": 1, **self.parallel}
        n = par["dp"] * par["tp"] * par["pp"]
        return {
            "version": 1,
            "model": {"file": str(FILES[self.model]), "num_blocks": 4},
            "cluster": {"profile": "a100-80g", "num_gpus": n, "gpus_per_node": 8},
            "training": {"global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
                         "seq_len": 32, "dtype": "fp32", "optimizer": "adamw"},
            "parallel": par,
        }


SP = {"tp": 2, "sequence_parallel": True}
CASES = share(2, [
    LabelCase(name="hf-glm4-tp2-sp", model="hf-glm4", parallel=SP),
    LabelCase(name="hf-cohere-tp2-sp", model="hf-cohere", parallel=SP),
    LabelCase(name="hf-mpt-tp2", model="hf-mpt", parallel={"tp": 2}),
])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_label_trained_hf_model_under_tp_trains_like_one_rank(case: LabelCase) -> None:
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    spec = model_spec(load_model_file(FILES[case.model]))
    for dim in ("tp", "sp") if case.parallel.get("sequence_parallel") else ("tp",):
        assert spec.support_reason(dim) is None, f"{dim} is not offered: {spec.support_reason(dim)}"
    got = result(2, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    assert got["vocab_sharded"], "the embedding and head were not sharded by vocabulary"
    assert not [n for n in got["notes"] if "all-gathered" in n], got["notes"]  # the loss ran vocab-parallel
    ref_losses, _, _ = reference_for(case)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-4)
