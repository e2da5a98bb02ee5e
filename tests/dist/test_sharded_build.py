"""ZeRO / FSDP2 plans are built one block at a time: a rank never holds its whole part unsharded.

On a GPU the part of a ZeRO-3 plan does not fit unsharded (that is why the plan shards it), so each
block gets its storage and seed values just before ``fully_shard`` shards it. Two gloo ranks build
ZeRO-3 (tp 1 and tp 2 x dp 2 would need 4 ranks; tp 1 keeps the spawn small) and ZeRO-1 plans of
the tiny GPT and record, at every ``fully_shard`` call, the bytes of parameters that are real and
not yet sharded; the equivalence of the trained weights is tests/dist/test_equivalence.py's.
"""

from __future__ import annotations

import sys

import pytest
import torch
from harness import SEED, Case
from shared import Job, result, share
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.dist

CASES = [Case(name="gpt-dp2-zero3", model="gpt", parallel={"dp": 2, "zero": 3}),
         Case(name="gpt-dp2-zero1", model="gpt", parallel={"dp": 2, "zero": 1}),
         Case(name="gpt-pp2xdp1-zero3", model="gpt", parallel={"pp": 2, "zero": 3, "pp_schedule": "1f1b"})]


def _whole_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters that have storage and are not sharded by FSDP2."""
    return sum(p.numel() * p.element_size() for p in module.parameters()
               if p.device.type != "meta" and not isinstance(p, DTensor))


def _build(_work_dir, case: Case) -> dict | None:
    """Rank 0: the fully_shard calls seen and the built model's full parameters."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    import autopar.executor.parallel.apply as apply_mod
    from autopar.executor.parallel.mesh import build_mesh
    from autopar.executor.parallel.pipeline_parallel import STAGE_PREFIX
    from autopar.executor.runtime.checks import preflight
    from autopar.modelfile import load_model_file

    plan = case.plan()
    mf = load_model_file(plan.model.file)
    spec, _ = preflight(plan, mf, dist.get_world_size())
    mesh = build_mesh(plan, torch.device("cpu"))
    seen: list[tuple[str, int, int, int]] = []  # (module, whole bytes of the part, root bytes, block bytes)
    parts: list[torch.nn.Module] = []
    real_wrap, real_shard = apply_mod.apply_data_parallel, fsdp.fully_shard

    def wrap(part, blocks, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        parts.append(part)
        return real_wrap(part, blocks, *args, **kwargs)

    def shard(module, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        part = parts[-1]
        blocks = apply_mod._blocks_of(part, spec, STAGE_PREFIX if plan.parallel.pp > 1 else "")
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        root = sum(p.numel() * p.element_size() for p in part.parameters() if id(p) not in in_blocks)
        block = max((sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks), default=0)
        seen.append((type(module).__name__, _whole_bytes(part), root, block))
        return real_shard(module, *args, **kwargs)

    apply_mod.apply_data_parallel, fsdp.fully_shard = wrap, shard
    try:
        exe = apply_mod.build_executable(plan, mf, spec, mesh, seed=SEED, lr=1e-3, loss_fn=mf.loss_fn)
    finally:
        apply_mod.apply_data_parallel, fsdp.fully_shard = real_wrap, real_shard
        # a module first imported during the build took the stand-ins by name (torch's pipelining
        # stage: ``from torch.distributed.fsdp import fully_shard``); later cases of the ranks'
        # shared spawn (tests/dist/shared.py) must find torch's own
        for module in list(sys.modules.values()):
            names = vars(module) if hasattr(module, "__dict__") else {}
            for name, stand_in, real in (("fully_shard", shard, real_shard), ("apply_data_parallel", wrap, real_wrap)):
                if names.get(name) is stand_in:
                    setattr(module, name, real)
    full = apply_mod.full_parameters(exe)
    return {"seen": seen, "params": full} if dist.get_rank() == 0 else None


# in the session's 2-rank spawn (tests/dist/shared.py); the names are the cases' with "build-" before
JOBS = {c.name: Job(name=f"build-{c.name}", fn=_build, args=(c,)) for c in CASES}
share(2, list(JOBS.values()))


def _results(case: str) -> dict:
    got = result(2, JOBS[case])
    assert isinstance(got, list), f"{case} failed:\n{got}"
    return got[0]


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_at_most_the_root_and_one_block_are_whole(case: str) -> None:
    seen = _results(case)["seen"]
    assert seen, "no fully_shard call recorded"
    for name, whole, root, block in seen:
        assert whole <= root + block, f"{name}: {whole} bytes whole on the device, more than root {root} + block {block}"
    # the blocks were really filled one by one: the first call saw at most one block beside the root
    assert seen[0][1] <= seen[0][2] + seen[0][3]


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_weights_are_the_seed_models(case: str) -> None:
    from autopar.executor.parallel.host_reference import build_reference
    from autopar.modelfile import load_model_file

    plan = CASES[[c.name for c in CASES].index(case)].plan()
    ref = dict(build_reference(load_model_file(plan.model.file), SEED).named_parameters())
    got = _results(case)["params"]
    if plan.parallel.pp > 1:
        pytest.skip("rank 0 holds stage 0 only")
    for name, t in ref.items():
        assert torch.equal(got[name], t.detach()), name
