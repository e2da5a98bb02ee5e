"""Issue 4 acceptance: every plan gives the single-process losses (fp32, rel 1e-4) and parameters.

Run in the session's spawns of 2, 4 and 8 ranks (tests/dist/shared.py), in sequence with the other modules' cases.
"""

from __future__ import annotations

import functools

import pytest
import torch
from harness import LR, STEPS, Case, reference_for
from shared import result, share

pytestmark = pytest.mark.dist


def _model_cases(model: str) -> list[Case]:
    c = functools.partial(Case, model=model)
    return [
        c(name=f"{model}-dp2", parallel={"dp": 2}),
        c(name=f"{model}-zero1", parallel={"dp": 2, "zero": 1}),
        c(name=f"{model}-zero2", parallel={"dp": 2, "zero": 2}),
        c(name=f"{model}-zero3", parallel={"dp": 2, "zero": 3}),
        c(name=f"{model}-tp2-sp", parallel={"tp": 2, "sequence_parallel": True}),
        c(name=f"{model}-tp2", parallel={"tp": 2}),
        c(name=f"{model}-cp2-ring", parallel={"cp": 2, "cp_kind": "ring"}),
        c(name=f"{model}-cp2-allgather", parallel={"cp": 2, "cp_kind": "allgather"}),
        c(name=f"{model}-cp2-ulysses", parallel={"cp": 2, "cp_kind": "ulysses"}),
        c(name=f"{model}-pp2-gpipe", parallel={"pp": 2, "pp_schedule": "gpipe"}),
        c(name=f"{model}-pp2-1f1b", parallel={"pp": 2, "pp_schedule": "1f1b"}),
        c(name=f"{model}-pp2-interleaved", parallel={"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2}),
        c(name=f"{model}-pp2-uneven", parallel={"pp": 2, "pp_schedule": "1f1b", "stages": [[0, 1], [1, 4]]}),
        c(name=f"{model}-dp2-selective", parallel={"dp": 2, "recompute": "selective"}),
        c(name=f"{model}-tp2-full", parallel={"tp": 2, "recompute": "full"}),
    ]


CASES_2 = share(2, _model_cases("gpt") + _model_cases("llama") + [
    Case(name="mlp-dp2", model="mlp", parallel={"dp": 2}),
    Case(name="mlp-zero3", model="mlp", parallel={"dp": 2, "zero": 3}),
    Case(name="mlp-pp2", model="mlp", parallel={"pp": 2, "pp_schedule": "1f1b"}),
    # a stage boundary that is a view (a block returning transposed strides) is sent dense
    Case(name="strided-pp2", model="strided", parallel={"pp": 2, "pp_schedule": "1f1b"}),
    # a loss_fn that cannot run on vocab-sharded logits: the executor all-gathers them instead
    Case(name="gpt-gather-loss-tp2", model="gpt-gather-loss", parallel={"tp": 2}),
    # per-op selective recompute across pipeline stages and around the ring's attention
    Case(name="llama-pp2-1f1b-op", model="llama", parallel={"pp": 2, "pp_schedule": "1f1b", "recompute": "op"}),
    Case(name="gpt-cp2-ring-op", model="gpt", parallel={"cp": 2, "cp_kind": "ring", "recompute": "op"}),
])
CASES_4 = share(4, [
    Case(name=f"{m}-dp2xtp2", model=m, parallel={"dp": 2, "tp": 2, "sequence_parallel": True}) for m in ("gpt", "llama")
] + [
    Case(name="gpt-dp2xtp2-zero3", model="gpt", parallel={"dp": 2, "tp": 2, "zero": 3}),
    # per-op selective recompute under FSDP2 and DTensor TP + SP (its reduce-scatters kept)
    Case(name="llama-dp2xtp2-sp-zero3-op", model="llama",
         parallel={"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 3, "recompute": "op"}),
    # tied embedding/head across stages with FSDP2-sharded gradients
    Case(name="gpt-pp2xdp2-zero3", model="gpt", parallel={"pp": 2, "dp": 2, "zero": 3, "pp_schedule": "gpipe"}),
    # ZeRO-3 keeps its per-micro-batch reduce-scatter under interleaved 1F1B (sync_every_microbatch)
    Case(name="gpt-pp2xdp2-zero3-interleaved", model="gpt",
         parallel={"pp": 2, "dp": 2, "zero": 3, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2},
         global_batch_size=8),
    # plain data parallelism under a pipeline (several forwards before their backwards: FSDP2 replicate)
    Case(name="llama-pp2xdp2-zero0", model="llama", parallel={"pp": 2, "dp": 2, "pp_schedule": "1f1b"},
         global_batch_size=8),
    Case(name="llama-cp2xtp2-ring", model="llama", parallel={"cp": 2, "tp": 2, "sequence_parallel": True}),
    Case(name="gpt-dp2xcp2-zero1", model="gpt", parallel={"dp": 2, "cp": 2, "cp_kind": "allgather", "zero": 1}),
    Case(name="gpt-pp2xcp2-ring", model="gpt", parallel={"pp": 2, "cp": 2, "pp_schedule": "1f1b"}),
    Case(name="llama-pp2xcp2-ulysses", model="llama", parallel={"pp": 2, "cp": 2, "cp_kind": "ulysses"}),
    # the last stage's loss on vocab-sharded logits falls back to the gather as the flat step does
    Case(name="gpt-gather-loss-pp2xtp2", model="gpt-gather-loss", parallel={"pp": 2, "tp": 2, "pp_schedule": "1f1b"}),
])
CASES_8 = share(8, [
    Case(name=f"{m}-pp2xdp2xtp2", model=m, parallel={"pp": 2, "dp": 2, "tp": 2, "pp_schedule": "1f1b"})
    for m in ("gpt", "llama")
])


def _check(world: int, case: Case) -> None:
    got = result(world, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, ref_params, ref_grads = reference_for(case)
    assert len(got["losses"]) == len(ref_losses)
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: loss {a} vs reference {b}"
    assert set(got["params"]) == set(ref_params), "parameter names differ from the single-process model"
    if case.parallel.get("tp", 1) > 1:
        # Megatron's vocab-parallel embedding and head, as the cost model assumes (tensor_parallel.py)
        assert got["vocab_sharded"] == ["output.weight", "tok_embeddings.weight"], got["vocab_sharded"]
        # The loss runs vocab-parallel (loss_parallel) unless loss_fn cannot take DTensor logits.
        gathered = any("all-gathered" in n for n in got["notes"])
        assert gathered == (case.model == "gpt-gather-loss"), got["notes"]
    # Gradients of step 1 are the sharp check: Adam is invariant to a constant gradient scale, so a
    # wrong 1/dp, 1/cp or 1/micro-batch factor would not show in the parameters.
    for name, ref in ref_grads.items():
        tol = 1e-4 * float(ref.abs().max()) + 1e-7
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-3, atol=tol, msg=lambda m: f"grad {name}: {m}")
    # Parameters after 3 AdamW steps, at atol = lr / 10. An element whose first gradient is at the
    # level of reduction-order noise (a dead unit: |g| <= 1e-6 max |g|) has no defined Adam direction:
    # m / sqrt(v) of noise is O(1), so it may move by up to one lr per step either way, and only that
    # bound holds for it.
    for name, ref in ref_params.items():
        g = ref_grads.get(name)
        noise = g.abs() <= 1e-6 * float(g.abs().max()) if g is not None else torch.zeros_like(ref, dtype=torch.bool)
        torch.testing.assert_close(got["params"][name][~noise], ref[~noise], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{name}: {m}")
        if bool(noise.any()):
            assert float((got["params"][name][noise] - ref[noise]).abs().max()) <= STEPS * LR * 1.01, name


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c.name)
def test_two_ranks(case: Case) -> None:
    _check(2, case)


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.name)
def test_four_ranks(case: Case) -> None:
    _check(4, case)


@pytest.mark.parametrize("case", CASES_8, ids=lambda c: c.name)
def test_eight_ranks(case: Case) -> None:
    _check(8, case)
