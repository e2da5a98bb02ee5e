"""Issue 14: plans with CPU offload and activation offload give the single-process run (2 gloo ranks).

The session's 2-rank spawn (tests/dist/shared.py) runs every case: optimizer offload
(executor/parallel/offload.py's HostOptimizer) at ZeRO-1, under a pipeline and with DDP plus
activation offload; FSDP2's CPUOffloadPolicy (params + grads + optimizer at ZeRO-3); activation
offload under tensor parallelism (DTensor activations). Each rank also reports what the executor
built, so a case that silently ran without offload fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import Case, reference_for
from shared import Job, result, share

pytestmark = pytest.mark.dist

OPT = {"optimizer": True}
CASES = [
    Case(name="gpt-dp2-zero1-offload-optimizer", model="gpt", parallel={"dp": 2, "zero": 1, "offload": OPT}),
    Case(name="gpt-dp2-zero3-offload-params", model="gpt",
         parallel={"dp": 2, "zero": 3, "offload": {"optimizer": True, "params": True, "grads": True}}),
    Case(name="gpt-dp2-ddp-offload-optimizer-activations", model="gpt",
         parallel={"dp": 2, "zero": 0, "offload": {"optimizer": True, "activations": True}}),
    Case(name="gpt-pp2-offload-optimizer", model="gpt", parallel={"pp": 2, "pp_schedule": "1f1b", "offload": OPT}),
    # the tied embedding/head on two pp ranks with their gradients on the host (sync_tied_grads)
    Case(name="gpt-pp2-zero3-offload-params", model="gpt",
         parallel={"pp": 2, "pp_schedule": "1f1b", "zero": 3,
                   "offload": {"optimizer": True, "params": True, "grads": True}}),
    Case(name="llama-tp2-offload-activations", model="llama", parallel={"tp": 2, "offload": {"activations": True}}),
]


def _built(case: Case) -> dict:
    """What build_executable made of ``case``'s offload: the optimizer's kind and where its states
    live, the FSDP2 offload policy, and the bytes the activation hooks copied in one step."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from autopar.executor.parallel.apply import build_executable
    from autopar.executor.parallel.mesh import build_mesh
    from autopar.executor.parallel.offload import HostOptimizer, OffloadSavedTensors
    from autopar.executor.runtime.checks import preflight
    from autopar.executor.runtime.train import train
    from autopar.modelfile import load_model_file

    plan = case.plan()
    mf = load_model_file(plan.model.file)
    spec, _ = preflight(plan, mf, dist.get_world_size())
    exe = build_executable(plan, mf, spec, build_mesh(plan, torch.device("cpu")), seed=1, lr=1e-3, loss_fn=mf.loss_fn)
    before = OffloadSavedTensors.host_bytes
    train(exe, mf, steps=1, seed=1)
    opt = exe.optimizer
    policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__  # noqa: SLF001
                for part in exe.parts for m in part.modules()
                if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None}  # noqa: SLF001
    return {"host_optimizer": isinstance(opt, HostOptimizer),
            "host_states": isinstance(opt, HostOptimizer) and len(opt.inner.state) == len(opt.masters) > 0
            and all(t.device.type == "cpu" for s in opt.inner.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor)),
            "cpu_offload_policy": CPUOffloadPolicy.__name__ in policies,
            "activation_bytes": OffloadSavedTensors.host_bytes - before}


def _built_on_rank(_work_dir, case: Case) -> dict:
    return _built(case)


# each case trains (harness._run_case), then is built once more to report what the executor made
share(2, CASES)
BUILT = {c.name: Job(name=f"{c.name}-built", fn=_built_on_rank, args=(c,), goes_with=c.name) for c in CASES}
share(2, list(BUILT.values()))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_offload_gives_the_single_process_run(case: Case) -> None:
    got = result(2, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, ref_params, _ = reference_for(case)
    assert len(got["losses"]) == len(ref_losses) == 3
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"step {step}: loss {a} vs reference {b}"
    for name, ref in ref_params.items():
        torch.testing.assert_close(got["params"][name], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    off = case.parallel["offload"]
    built = result(2, BUILT[case.name])
    assert isinstance(built, list), f"{case.name}'s build failed:\n{built}"
    built = built[0]
    # Optimizer-only offload runs HostOptimizer; FSDP2's policy covers the params case (its optimizer
    # is a plain one over host parameters); activations went through the hooks.
    assert built["host_optimizer"] == (off.get("optimizer", False) and not off.get("params", False)), built
    assert built["host_states"] == built["host_optimizer"], built
    assert built["cpu_offload_policy"] == off.get("params", False), built
    assert (built["activation_bytes"] > 0) == off.get("activations", False), built
