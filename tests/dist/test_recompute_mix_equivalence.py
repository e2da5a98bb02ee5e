"""Issue 14: a plan with a per-stage recompute mix (``parallel.recompute_blocks``) on 2 gloo ranks
(pp 2) gives the one-rank losses, gradients and parameters, and each block runs the mode the plan's
rule gives it (``Plan.block_recompute``: a rank's first blocks full, then selective, then none).

In the session's 2-rank spawn (tests/dist/shared.py): each case trains 3 steps (``harness._run_case``),
then is built once more so every rank can report which of its modules run under checkpoint.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from harness import SEED, Case, reference_for
from shared import Job, result, share

pytestmark = pytest.mark.dist

CASES = [
    Case(name="gpt-pp2-1f1b-mix", model="gpt",
         parallel={"pp": 2, "pp_schedule": "1f1b", "recompute": "full",
                   "recompute_blocks": [{"none": 0, "selective": 1, "full": 1}, {"none": 1, "selective": 1, "full": 0}]}),
    Case(name="gpt-pp2-uneven-mix", model="gpt",
         parallel={"pp": 2, "pp_schedule": "1f1b", "stages": [[0, 3], [3, 4]],
                   "recompute_blocks": [{"none": 1, "selective": 0, "full": 2}, {"none": 0, "selective": 1, "full": 0}]}),
    Case(name="llama-pp2-interleaved-mix", model="llama",
         parallel={"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2,
                   "recompute_blocks": [{"none": 1, "selective": 0, "full": 1}, {"none": 1, "selective": 1, "full": 0}]}),
]


def _checkpointed(_work_dir, case: Case) -> dict:
    """Which module names of this rank's chunks run under checkpoint (an instance ``forward``)."""
    from autopar.executor.parallel.apply import build_executable
    from autopar.executor.parallel.mesh import build_mesh
    from autopar.executor.runtime.checks import preflight
    from autopar.modelfile import load_model_file

    plan = case.plan()
    mf = load_model_file(plan.model.file)
    spec, _ = preflight(plan, mf, dist.get_world_size())
    exe = build_executable(plan, mf, spec, build_mesh(plan, torch.device("cpu")), seed=SEED, lr=1e-3,
                           loss_fn=mf.loss_fn)
    names = sorted(name for part in exe.parts for name, mod in part.named_modules() if "forward" in vars(mod))
    return {"blocks_path": spec.blocks_path, "core": spec.core_name, "names": names}


share(2, CASES)
MODES = share(2, [Job(name=f"{c.name}-modes", fn=_checkpointed, args=(c,), goes_with=c.name) for c in CASES])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_recompute_mix_gives_the_one_rank_losses(case: Case) -> None:
    got = result(2, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, ref_params, ref_grads = reference_for(case)
    assert len(got["losses"]) == len(ref_losses) == 3
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: loss {a} vs reference {b}"
    for name, ref in ref_grads.items():
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-3, atol=1e-5, msg=lambda m: f"grad {name}: {m}")
    for name, ref in ref_params.items():
        torch.testing.assert_close(got["params"][name], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_block_runs_the_mode_the_plan_gives_it(case: Case) -> None:
    ranks = result(2, MODES[CASES.index(case)])
    assert isinstance(ranks, list), f"{case.name} failed:\n{ranks}"
    modes = case.plan().block_recompute()
    assert len(set(modes)) >= 2  # a real mix
    seen: dict[int, str] = {}
    for record in ranks:
        blocks = re.escape(record["blocks_path"])
        for name in record["names"]:
            m = re.search(rf"(?:^|\.){blocks}\.(\d+)(\.(.+))?$", name)
            if m is None:
                continue
            block, sub = int(m.group(1)), m.group(3)
            assert block not in seen, f"block {block} checkpointed twice: {name}"
            assert sub in (None, record["core"]), name
            seen[block] = "full" if sub is None else "selective"
    assert seen == {b: m for b, m in enumerate(modes) if m != "none"}
