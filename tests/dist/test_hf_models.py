"""Issue 11, build point 3: the executor runs real module code -- Hugging Face ``*ForCausalLM`` models
(keyword block arguments, rotary tuples from the prologue, ``ModelOutput`` results, dict inputs with
the loss inside the model), a network under an attribute named ``model``, bare ``nn.Parameter``s and
tuple-returning blocks, post-LN blocks under SP (BERT), 0-d parameters under ZeRO -- under every
dimension the planner offers, training like one rank (fp32, losses rel 1e-4 over 3 steps, step-1
gradients and final parameters).

The session's spawns of 2 and 4 gloo ranks run its cases in sequence (tests/dist/shared.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from harness import ZOO, Case, reference_for  # noqa: E402
from shared import result, share  # noqa: E402

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent / "models"
# name -> (model file, blocks, sequence length)
FILES: dict[str, tuple[Path, int, int]] = {
    "hf-llama": (ZOO / "hf_llama.py", 4, 32),
    "hf-mistral": (ZOO / "hf_mistral.py", 4, 32),  # sliding window 16 < 32 tokens
    "hf-qwen2": (ZOO / "hf_qwen2.py", 4, 32),  # dict inputs, loss computed by the model
    "hf-gpt2": (ZOO / "hf_gpt2.py", 4, 32),  # Conv1D layers (their TP styles: tests/dist/test_tp_foreign.py)
    "under-model": (HERE / "under_model.py", 4, 32),  # the network sits in .model
    "bare-vit": (HERE / "bare_params_vit.py", 4, 1),  # bare parameters, tuple-returning blocks
    "bare-pos-gpt": (ZOO / "bare_pos_gpt.py", 4, 32),  # a bare positional parameter, tied head
    "hf-bert": (ZOO / "hf_bert.py", 4, 32),  # post-LN: a norm's output meets a rowwise output under SP
    "scalar-params": (HERE / "scalar_params.py", 4, 1),  # 0-d parameters, which FSDP2 cannot shard
}
# Which support key of the model spec each plan dimension needs (to assert the case is offered).
_DIMS = {"tp": lambda p: p.get("tp", 1) > 1, "sp": lambda p: p.get("sequence_parallel", False),
         "pp": lambda p: p.get("pp", 1) > 1, "cp": lambda p: p.get("cp", 1) > 1,
         "zero3": lambda p: p.get("zero", 0) == 3, "selective": lambda p: p.get("recompute") == "selective"}


@dataclass(frozen=True, kw_only=True)
class FileCase(Case):
    """A harness Case whose model is one of FILES (picklable: spawned workers import this module)."""

    def plan_dict(self) -> dict[str, Any]:
        path, blocks, seq = FILES[self.model]
        par = {"dp": 1, "tp": 1, "pp": 1, **self.parallel}
        n = par["dp"] * par["tp"] * par["pp"] * par.get("cp", 1)
        return {
            "version": 1,
            "model": {"file": str(path), "num_blocks": blocks},
            "cluster": {"profile": "a100-80g", "num_gpus": n, "gpus_per_node": 8},
            "training": {"global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
                         "seq_len": seq, "dtype": "fp32", "optimizer": "adamw"},
            "parallel": par,
        }


def _cases(model: str, *names: str) -> list[FileCase]:
    plans = {
        "dp2": {"dp": 2}, "zero1": {"dp": 2, "zero": 1}, "zero2": {"dp": 2, "zero": 2},
        "zero3": {"dp": 2, "zero": 3}, "tp2": {"tp": 2}, "tp2-sp": {"tp": 2, "sequence_parallel": True},
        "pp2-gpipe": {"pp": 2, "pp_schedule": "gpipe"}, "pp2-1f1b": {"pp": 2, "pp_schedule": "1f1b"},
        "pp2-uneven": {"pp": 2, "pp_schedule": "1f1b", "stages": [[0, 1], [1, 4]]},
        "pp2-interleaved": {"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2},
        "cp2-ring": {"cp": 2, "cp_kind": "ring"}, "cp2-ulysses": {"cp": 2, "cp_kind": "ulysses"},
        "cp2-allgather": {"cp": 2, "cp_kind": "allgather"}, "dp2-selective": {"dp": 2, "recompute": "selective"},
        "cp2-selective": {"cp": 2, "cp_kind": "ring", "recompute": "selective"},
        "dp2-full": {"dp": 2, "recompute": "full"},
    }
    return [FileCase(name=f"{model}-{n}", model=model, parallel=plans[n]) for n in names]


CASES = share(2, (
    _cases("hf-llama", "dp2", "zero1", "zero3", "tp2-sp", "pp2-1f1b", "pp2-gpipe", "cp2-ring", "dp2-selective",
           "dp2-full", "cp2-selective")
    + _cases("hf-mistral", "dp2", "tp2-sp", "pp2-1f1b")
    + _cases("hf-qwen2", "zero2", "tp2-sp", "pp2-1f1b")
    + _cases("hf-gpt2", "zero3", "pp2-1f1b", "cp2-allgather")
    + _cases("under-model", "dp2", "tp2-sp", "cp2-ring", "pp2-1f1b")
    + _cases("bare-vit", "zero3", "pp2-1f1b", "pp2-interleaved")
    + _cases("bare-pos-gpt", "pp2-1f1b", "tp2")
    + _cases("hf-bert", "tp2-sp", "tp2")
    + _cases("scalar-params", "zero1", "zero3")
))
# Four ranks: pipeline stages combined with tensor (+ sequence) and context parallelism on HF Llama.
CASES_4 = share(4, [
    FileCase(name="hf-llama-pp2xtp2-sp", model="hf-llama",
             parallel={"pp": 2, "tp": 2, "sequence_parallel": True, "pp_schedule": "1f1b"}),
    FileCase(name="hf-llama-pp2xcp2", model="hf-llama", parallel={"pp": 2, "cp": 2, "cp_kind": "allgather"}),
    FileCase(name="hf-qwen2-pp2xdp2-zero3", model="hf-qwen2", parallel={"pp": 2, "dp": 2, "zero": 3}),
])


def _check(world: int, case: FileCase) -> None:
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    spec = model_spec(load_model_file(FILES[case.model][0]))
    for dim, used in _DIMS.items():
        if used(case.parallel):
            assert spec.support_reason(dim) is None, f"{dim} is not offered: {spec.support_reason(dim)}"
    got = result(world, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, ref_params, ref_grads = reference_for(case)
    assert len(got["losses"]) == len(ref_losses)
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: loss {a} vs reference {b}"
    assert set(got["params"]) == set(ref_params), "parameter names differ from the single-process model"
    for name, ref in ref_grads.items():
        tol = 1e-4 * float(ref.abs().max()) + 1e-7
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-3, atol=tol, msg=lambda m: f"grad {name}: {m}")
    for name, ref in ref_params.items():
        torch.testing.assert_close(got["params"][name], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_two_ranks(case: FileCase) -> None:
    _check(2, case)


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.name)
def test_four_ranks(case: FileCase) -> None:
    _check(4, case)
