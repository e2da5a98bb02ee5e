"""Expert parallelism trains like one rank. HF Mixtral (stacked experts, the model's own
expert loop on each rank's rows) and a plain-torch top-k MoE (an ``nn.ModuleList`` of experts under
the model's own routing code) under ep2 (2 gloo ranks) and ep2 x dp2 (4 ranks), with the router's
natural uneven routing (asserted), give the single-process losses (rel 1e-4 over 3 steps),
step-1 gradients and final parameters; ZeRO-1 and ZeRO-3 shard the experts over their edp ranks;
HF Mixtral also with ep drawn from the cp ranks (cp2 x ep2) and with one expert per rank under
ZeRO-2 (ep4, 4 ranks); both with a pipeline (pp2 x dp2 x ep2, 4 ranks: 1F1B at ZeRO-1, GPipe at
ZeRO-0) and with tensor parallelism (tp2 x dp2 x ep2, 4 ranks: the plain MoE's experts sharded over
tp by its TP plan, HF Mixtral's whole on each tp rank). The other expert layouts found by behaviour
at ep2: plain-torch 3-D stacks with per-expert biases and a shared expert, HF gpt-oss (biased router,
per-expert biases, ZeRO-1), HF DBRX (weights packed along their rows, ZeRO-3) and HF JetMoE (stacks
called with rows grouped by expert and the rows per expert, ZeRO-1; a plain-torch one passing the
counts as a tensor by keyword, ZeRO-3). Layer chains
whose later units hold the experts: HF DeepSeek-V3 (a dense first layer; ep2 at ZeRO-1, with the
block-list pipeline pp2 x dp2 x ep2 and with tensor parallelism tp2 x dp2 x ep2) and a plain-torch
chain with an nn.ModuleList of experts (ep2, ZeRO-3). Sequence parallelism through HF Mixtral's MoE
layers (each tp rank routes its sequence shard; ep drawn from dp x tp, tp first): tp2 x ep2,
tp2 x dp2 x ep4 (ZeRO-1) and tp2 x dp2 x ep2 (ZeRO-0).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import SEED, STEPS, ZOO, Case, reference_for
from shared import result, share

pytestmark = pytest.mark.dist

# name -> (model file, blocks, sequence length, needs transformers)
FILES = {
    "torch-moe": (ZOO / "torch_moe.py", 4, 32, False),
    "hf-mixtral": (ZOO / "hf_mixtral.py", 4, 32, True),
    # experts found by behaviour beyond Mixtral's layout: 3-D stacks with per-expert biases beside a
    # shared expert (plain torch), a biased router and other argument names (gpt-oss), weights packed
    # along their rows (DBRX)
    "torch-moe-stacked": (ZOO / "torch_moe_stacked.py", 4, 32, False),
    "hf-gpt-oss": (ZOO / "hf_gpt_oss.py", 4, 32, True),
    "hf-dbrx": (ZOO / "hf_dbrx.py", 4, 32, True),
    # stacks called with their rows already grouped by expert and the rows per expert, the MoE
    # module's own code routing and scattering (JetMoE's up and down projections, two exchanges)
    "hf-jetmoe": (ZOO / "hf_jetmoe.py", 4, 64, True),
    # the same call under other conventions: counts an integer tensor by keyword, per-expert biases
    "grouped-moe": (Path(__file__).resolve().parent / "models" / "grouped_moe.py", 4, 16, False),
    # a layer chain whose later units hold the experts: HF DeepSeek-V3 (a dense first layer, then
    # stacked experts beside a shared expert) and a plain-torch one with an nn.ModuleList of experts
    "hf-deepseek-v3": (ZOO / "hf_deepseek_v3.py", 4, 32, True),
    "chain-moe-list": (Path(__file__).resolve().parent / "models" / "chain_moe_list.py", 4, 16, False),
    # one expert per ep rank, more than one edp rank: FSDP2 shards the experts on another dimension
    "moe-two-experts": (Path(__file__).resolve().parent / "models" / "moe_two_experts.py", 4, 32, False),
}
_FIRST = ("torch-moe", "hf-mixtral")  # the layouts every combination of degrees is tested on


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class MoECase(Case):
    """A harness Case whose model is one of FILES (picklable: spawned workers import this module)."""

    def plan_dict(self) -> dict[str, Any]:
        path, blocks, seq, _ = FILES[self.model]
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


def _models(names: tuple[str, ...] = _FIRST) -> list[str]:
    return [m for m in names if not FILES[m][3] or _has_transformers()]


CASES_2 = [MoECase(name=f"{m}-ep2", model=m, parallel={"dp": 2, "ep": 2}) for m in _models()] + [
    MoECase(name=f"{m}-ep2-zero3", model=m, parallel={"dp": 2, "ep": 2, "zero": 3}) for m in _models()] + [
    # ep drawn from the cp ranks: each holds half of every sequence (HF attention runs CP; the plain MoE has no core)
    MoECase(name="hf-mixtral-cp2-ep2", model="hf-mixtral", parallel={"cp": 2, "ep": 2, "cp_kind": "allgather"})
    for m in _models() if m == "hf-mixtral"] + [
    # the other expert layouts at ep2 (with ZeRO-1 and ZeRO-3 over their edp ranks)
    MoECase(name=f"{m}-ep2", model=m, parallel={"dp": 2, "ep": 2, **extra})
    for m, extra in (("torch-moe-stacked", {}), ("hf-gpt-oss", {"zero": 1}), ("hf-dbrx", {"zero": 3}),
                     ("hf-jetmoe", {"zero": 1}), ("grouped-moe", {"zero": 3}))
    if m in _models(("torch-moe-stacked", "hf-gpt-oss", "hf-dbrx", "hf-jetmoe", "grouped-moe"))] + [
    # a chain's MoE units (the dense first one keeps its MLP whole)
    MoECase(name=f"{m}-ep2", model=m, parallel={"dp": 2, "ep": 2, **extra})
    for m, extra in (("hf-deepseek-v3", {"zero": 1}), ("chain-moe-list", {"zero": 3}))
    if m in _models(("hf-deepseek-v3", "chain-moe-list"))] + [
    # sequence parallelism through the MoE layers: each tp rank routes its sequence shard, the ep
    # ranks drawn from the tp ranks (Megatron-Core's MoE parallel folding); the router's and the
    # experts' gradients reduced over them
    MoECase(name="hf-mixtral-tp2-sp-ep2", model="hf-mixtral", parallel={"tp": 2, "sequence_parallel": True, "ep": 2})
    for m in _models() if m == "hf-mixtral"]
CASES_4 = [MoECase(name=f"{m}-ep2xdp2", model=m, parallel={"dp": 4, "ep": 2}) for m in _models()] + [
    MoECase(name=f"{m}-ep2xdp2-zero1", model=m, parallel={"dp": 4, "ep": 2, "zero": 1}) for m in _models()] + [
    # one expert per rank under ZeRO-2 (what the planner picks for Mixtral-8x7B at 64 A100s)
    MoECase(name="hf-mixtral-ep4-zero2", model="hf-mixtral", parallel={"dp": 4, "ep": 4, "zero": 2})
    for m in _models() if m == "hf-mixtral"] + [
    # pp2 x dp2 x ep2: each stage's two ranks exchange tokens; the pipelining API's first-step
    # metadata inference runs a stage on uninitialised inputs, so the routing there is arbitrary
    MoECase(name=f"{m}-pp2xdp2xep2-zero{z}", model=m, global_batch_size=8,
            parallel={"dp": 2, "pp": 2, "ep": 2, "zero": z, "pp_schedule": s})
    for m, z, s in (("torch-moe", 1, "1f1b"), ("hf-mixtral", 0, "gpipe")) if m in _models()] + [
    # tp2 x dp2 x ep2: the plain MoE's TP plan shards its expert Linears (expert tensor parallelism),
    # HF Mixtral's stacked experts stay whole on both tp ranks (attention is tensor-parallel)
    MoECase(name=f"{m}-tp2xdp2xep2-zero{z}", model=m, parallel={"dp": 2, "tp": 2, "ep": 2, "zero": z})
    for m, z in (("torch-moe", 0), ("hf-mixtral", 1)) if m in _models()] + [
    # a chain's MoE units cut by the block-list pipeline (stage 0: the dense layer and one MoE
    # layer; stage 1: two MoE layers)
    MoECase(name="hf-deepseek-v3-pp2xdp2xep2-zero0", model="hf-deepseek-v3", global_batch_size=8,
            parallel={"dp": 2, "pp": 2, "ep": 2, "zero": 0, "pp_schedule": "1f1b"}),
    # beside tensor-parallel latent attention (the shared rotary key's gradient summed over the tp
    # ranks: TPPlan.grad_sums) and tensor-parallel shared experts; the routed experts whole per tp rank
    MoECase(name="hf-deepseek-v3-tp2xdp2xep2-zero1", model="hf-deepseek-v3",
            parallel={"dp": 2, "tp": 2, "ep": 2, "zero": 1})] if _models(("hf-deepseek-v3",)) else []
CASES_4 += [
    MoECase(name=f"moe-two-experts-ep2xdp4-zero{z}", model="moe-two-experts", parallel={"dp": 4, "ep": 2, "zero": z})
    for z in (1, 3)] + [
    # sequence parallelism through the MoE layers over dp x tp: ep 4 across both (ZeRO-1 shards the
    # experts over their edp ranks), and ep 2 over the tp ranks at ZeRO-0 (FSDP2's replicate reduces
    # the experts and the router over dp x tp)
    MoECase(name=f"hf-mixtral-tp2xdp2-sp-ep{ep}-zero{z}", model="hf-mixtral",
            parallel={"dp": 2, "tp": 2, "sequence_parallel": True, "ep": ep, "zero": z})
    for ep, z in ((4, 1), (2, 0)) if "hf-mixtral" in _models()]
CASES_2, CASES_4 = share(2, CASES_2), share(4, CASES_4)  # in the session's shared spawns (shared.py)
ALL = [(2, c) for c in CASES_2] + [(4, c) for c in CASES_4]


def _routing_is_uneven(model: str) -> bool:
    """The first block's router on the first step's batch sends different numbers of tokens to
    the experts (so the all-to-all's splits are uneven)."""
    from autopar.executor.runtime.train import global_batch
    from autopar.modelfile import call_model, load_model_file
    from autopar.spec import model_spec

    plan = MoECase(name="ref", model=model).plan()
    mf = load_model_file(plan.model.file)
    torch.manual_seed(SEED)
    m = mf.build("cpu")
    spec = model_spec(mf)
    block = m.get_submodule(spec.moe_units[0])  # the first unit holding experts (a chain's may not be the first)
    seen: list[torch.Tensor] = []
    hook = block.get_submodule(spec.moe.router_name).register_forward_hook(lambda _m, _i, o: seen.append(o))
    with torch.no_grad():
        call_model(m, global_batch(mf, plan.training.global_batch_size, 0, SEED))  # a tensor or a dict batch
    hook.remove()
    out = seen[0][0] if isinstance(seen[0], tuple) else seen[0]
    idx = out.topk(spec.moe.top_k, dim=-1).indices
    counts = torch.bincount(idx.flatten(), minlength=spec.moe.num_experts)
    return int(counts.max()) > int(counts.min())


@pytest.mark.parametrize("world,case", ALL, ids=lambda x: x.name if isinstance(x, Case) else f"{x}ranks")
def test_expert_parallel_trains_like_one_rank(world: int, case: MoECase) -> None:
    assert _routing_is_uneven(case.model), "the test needs uneven routing"
    got = result(world, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, ref_params, ref_grads = reference_for(case)
    assert len(got["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: loss {a} vs reference {b}"
    assert set(got["params"]) == set(ref_params), "expert parameters missing from the gathered model"
    for name, ref in ref_grads.items():
        tol = 1e-4 * float(ref.abs().max()) + 1e-7
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-3, atol=tol, msg=lambda m: f"grad {name}: {m}")
    for name, ref in ref_params.items():
        torch.testing.assert_close(got["params"][name], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
