"""Optimizer offload in 16-bit training keeps the device's sharded parameters and gradients in the
training dtype (2 gloo ranks, bf16, ZeRO-1 over FSDP2).

The fp32 masters and Adam's moments live on the host (executor/parallel/offload.py ``HostOptimizer``), so the
device holds 2 + 2 bytes per sharded parameter, as ZeRO-Offload does and autopar.cost.offload
prices -- not FSDP2's default fp32 shard plus an fp32 gradient. Compared with the same plan without
offload: the first step's loss is the same (both compute with the bf16 weights), later steps stay
within bf16 rounding (the masters start from the bf16 weights), and the device's parameter bytes
are half.

And ZeRO-0 under a pipeline (FSDP2's ``replicate``, 4 gloo ranks) trains in bf16 under FSDP2's
mixed-precision policy, not autocast: it computes what ZeRO-1 computes there.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import Case
from shared import Job, result, share

pytestmark = pytest.mark.dist

PLAIN = Case(name="bf16-dp2-zero1", model="gpt", parallel={"dp": 2, "zero": 1})
OFFLOAD = Case(name="bf16-dp2-zero1-offload-optimizer", model="gpt",
               parallel={"dp": 2, "zero": 1, "offload": {"optimizer": True}})


def _bf16_plan(case: Case):
    from autopar.plan import plan_from_dict

    d = case.plan_dict()
    d["training"]["dtype"] = "bf16"
    return plan_from_dict(d)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _one(_work_dir, case: Case) -> dict:
    from autopar.executor.parallel.apply import build_executable
    from autopar.executor.parallel.mesh import build_mesh
    from autopar.executor.parallel.offload import HostOptimizer
    from autopar.executor.runtime.checks import preflight
    from autopar.executor.runtime.train import train
    from autopar.modelfile import load_model_file

    plan = _bf16_plan(case)
    mf = load_model_file(plan.model.file)
    spec, _ = preflight(plan, mf, dist.get_world_size())
    exe = build_executable(plan, mf, spec, build_mesh(plan, torch.device("cpu")), seed=7, lr=1e-3, loss_fn=mf.loss_fn)
    params = [p for part in exe.parts for p in part.parameters()]
    grad_dtypes: set[str] = set()
    hidden_dtypes: set[str] = set()  # the residual stream between blocks
    for part in exe.parts:
        for m in part.modules():
            if "GPTBlock" in type(m).__name__:
                m.register_forward_hook(lambda _m, _a, out: hidden_dtypes.add(str(_local(out).dtype)))

    def grab(step: int) -> None:
        grad_dtypes.update(str(_local(p.grad).dtype) for p in params if p.grad is not None)

    result = train(exe, mf, steps=3, seed=7, on_grads=grab)
    opt = exe.optimizer
    return {"losses": list(result.losses),
            "param_dtypes": sorted({str(_local(p).dtype) for p in params}),
            "grad_dtypes": sorted(grad_dtypes),
            "hidden_dtypes": sorted(hidden_dtypes),
            "param_bytes": sum(_local(p).untyped_storage().nbytes() for p in params),
            "master_dtypes": sorted({str(m.dtype) for m in opt.masters}) if isinstance(opt, HostOptimizer) else []}


# ZeRO-0 under a pipeline is FSDP2's replicate, which trains in bf16 under the same mixed-precision
# policy as FSDP2 (not autocast over fp32 weights): it computes what ZeRO-1 computes
PP_ZERO1 = Case(name="bf16-pp2-dp2-zero1", model="gpt", parallel={"pp": 2, "dp": 2, "zero": 1, "pp_schedule": "1f1b"})
PP_ZERO0 = Case(name="bf16-pp2-dp2-zero0", model="gpt", parallel={"pp": 2, "dp": 2, "zero": 0, "pp_schedule": "1f1b"})


# in the session's spawns of 2 and 4 ranks (tests/dist/shared.py)
WORLD = {PLAIN.name: 2, OFFLOAD.name: 2, PP_ZERO1.name: 4, PP_ZERO0.name: 4}
JOBS = {c.name: Job(name=c.name, fn=_one, args=(c,)) for c in (PLAIN, OFFLOAD, PP_ZERO1, PP_ZERO0)}
for _name, _world in WORLD.items():
    share(_world, [JOBS[_name]])


def _got(case: Case) -> dict:
    got = result(WORLD[case.name], JOBS[case.name])
    assert isinstance(got, list), f"{case.name} failed:\n{got}"
    return got[0]  # rank 0's


def test_optimizer_offload_keeps_bf16_params_and_grads_on_the_device() -> None:
    plain, off = _got(PLAIN), _got(OFFLOAD)
    assert plain["param_dtypes"] == ["torch.float32"], plain  # FSDP2's shard is the fp32 master
    assert off["param_dtypes"] == ["torch.bfloat16"], off
    assert off["grad_dtypes"] == ["torch.bfloat16"], off
    assert off["master_dtypes"] == ["torch.float32"], off
    assert off["param_bytes"] * 2 == plain["param_bytes"]


def test_optimizer_offload_in_bf16_trains_like_the_plan_without_it() -> None:
    plain, off = _got(PLAIN), _got(OFFLOAD)
    assert off["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-6)
    for step, (a, b) in enumerate(zip(off["losses"], plain["losses"])):
        assert abs(a - b) <= 5e-3 * abs(b), f"step {step}: loss {a} with offload vs {b} without"


def test_replicate_trains_in_bf16_under_fsdp2s_policy() -> None:
    zero1, zero0 = _got(PP_ZERO1), _got(PP_ZERO0)
    assert zero0["param_dtypes"] == ["torch.float32"], zero0  # the fp32 parameters are the optimizer's
    assert zero0["grad_dtypes"] == ["torch.float32"], zero0
    # autocast over fp32 weights kept the residual stream in fp32 (twice the activations priced)
    assert zero0["hidden_dtypes"] == zero1["hidden_dtypes"] == ["torch.bfloat16"], (zero0, zero1)
    for step, (a, b) in enumerate(zip(zero0["losses"], zero1["losses"])):
        assert abs(a - b) <= 1e-3 * abs(b), f"step {step}: loss {a} under replicate vs {b} under FSDP2"
