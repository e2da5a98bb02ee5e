"""Issue 11 (models that do not repeat one block): a ResNet-like conv net (stages of different
widths: a layer chain), a ViT whose blocks sit in an nn.Sequential (with a bare class token and
position table) and HF T5 (encoder and decoder blocks) train like one process under every
dimension the planner offers them: dp2, zero3 and pp2 (the session's 2-rank spawn, fp32, 3 steps). A decoder whose
one ModuleList holds dense then MoE blocks, each reading a mask and a position table beside its
input (tests/dist/models/mixed_blocks.py, DeepSeek-V3's layout), pipelines as a block list."""

from __future__ import annotations

import importlib.util

import harness
import pytest
import torch
from harness import HERE, ZOO, Case, reference_for
from shared import result, share

pytestmark = pytest.mark.dist

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# the zoo's ViT and T5; a ResNet with 2 blocks in its second stage (a unit kind repeated)
MODELS = {"resnet": (HERE / "models" / "chain_resnet.py", 5, 1), "vit": (ZOO / "vit.py", 4, 1), "t5": (ZOO / "hf_t5.py", 8, 32),
          "mixed": (HERE / "models" / "mixed_blocks.py", 4, 16)}
for _name, (_file, _units, _seq) in MODELS.items():  # the harness's tables, in this module and its workers
    harness.MODELS[_name] = _file
    harness.BLOCKS[_name] = _units
    harness.SEQ[_name] = _seq


class ChainCase(Case):
    """A Case of this module: unpickling it in a worker imports this module, which registers the
    models above in the harness there too."""


CASES = [
    ChainCase(name="resnet-dp2", model="resnet", parallel={"dp": 2}),
    ChainCase(name="resnet-zero3", model="resnet", parallel={"dp": 2, "zero": 3}),
    ChainCase(name="resnet-pp2-1f1b", model="resnet", parallel={"pp": 2, "pp_schedule": "1f1b", "stages": [[0, 3], [3, 5]]}),
    ChainCase(name="resnet-pp2-gpipe-full", model="resnet",
              parallel={"pp": 2, "pp_schedule": "gpipe", "recompute": "full", "stages": [[0, 1], [1, 5]]}),
    ChainCase(name="vit-dp2", model="vit", parallel={"dp": 2}),
    ChainCase(name="vit-zero3", model="vit", parallel={"dp": 2, "zero": 3}),
    ChainCase(name="vit-pp2", model="vit", parallel={"pp": 2, "pp_schedule": "1f1b"}),
    # dense, dense | moe, moe would cut at the kind boundary; these cuts put both kinds on one stage
    ChainCase(name="mixed-pp2-1f1b", model="mixed", parallel={"pp": 2, "pp_schedule": "1f1b", "stages": [[0, 3], [3, 4]]}),
    ChainCase(name="mixed-pp2-gpipe-full", model="mixed",
              parallel={"pp": 2, "pp_schedule": "gpipe", "recompute": "full", "stages": [[0, 1], [1, 4]]}),
    ChainCase(name="mixed-pp2-interleaved", model="mixed",
              parallel={"pp": 2, "pp_virtual_stages": 2, "pp_schedule": "interleaved-1f1b",
                        "stages": [[0, 1], [1, 2], [2, 3], [3, 4]]}),
    ChainCase(name="mixed-zero3", model="mixed", parallel={"dp": 2, "zero": 3}),
]
if HAS_TRANSFORMERS:
    CASES += [ChainCase(name="t5-dp2", model="t5", parallel={"dp": 2}),
              ChainCase(name="t5-zero3", model="t5", parallel={"dp": 2, "zero": 3})]
share(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_chain_model_trains_like_one_rank(case: ChainCase) -> None:
    got = result(2, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, ref_params, ref_grads = reference_for(case)
    assert len(got["losses"]) == len(ref_losses) == 3
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: loss {a} vs reference {b}"
    assert set(got["params"]) == set(ref_params), "parameter names differ from the single-process model"
    for name, ref in ref_grads.items():
        tol = 1e-4 * float(ref.abs().max()) + 1e-7
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-3, atol=tol, msg=lambda m: f"grad {name}: {m}")
    for name, ref in ref_params.items():
        # Elements whose gradient is rounding noise (a ViT's key bias: softmax ignores a shift of all
        # logits, so its true gradient is 0) take lr-sized AdamW steps in any direction; compare the rest.
        g = ref_grads.get(name)
        keep = (g.abs() > 1e-5 * float(g.abs().max()) if g is not None and float(g.abs().max()) > 0
                else torch.ones_like(ref, dtype=torch.bool))
        torch.testing.assert_close(got["params"][name][keep], ref[keep], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
