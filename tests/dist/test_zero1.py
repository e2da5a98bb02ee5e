"""Issue 12: ZeRO-1 at any tp is FSDP2 with one reduce-scatter and one all-gather per step.

The session's 4-rank gloo spawn (tests/dist/shared.py) runs (a) equivalence cases -- ZeRO-1 at tp2 x dp2 (with and without SP), at tp 1
and under a pipeline give the single-process losses, gradients and parameters, as tests/dist/test_equivalence.py
checks them -- and (b) a count of FSDP2's collectives in one step at 2 and at 4 micro-batches, for
ZeRO-1 and ZeRO-2: ZeRO-1's count does not change with the micro-batches, ZeRO-2's grows with them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import SEED, Case, reference_for
from shared import Job, result, share

pytestmark = pytest.mark.dist

EQUIVALENCE = share(4, [
    Case(name="gpt-tp2xdp2-zero1", model="gpt", parallel={"tp": 2, "dp": 2, "zero": 1}),
    Case(name="llama-tp2xdp2-zero1-sp", model="llama", parallel={"tp": 2, "dp": 2, "zero": 1, "sequence_parallel": True}),
    Case(name="gpt-dp4-zero1", model="gpt", parallel={"dp": 4, "zero": 1}, global_batch_size=8),
    # at pp > 1 torch's pipelining stage switches the gradient sync itself (cost.zero.executed_zero)
    Case(name="gpt-pp2xdp2-zero1", model="gpt", parallel={"pp": 2, "dp": 2, "zero": 1, "pp_schedule": "1f1b"}),
])
# (case, micro-batches per dp rank): global batch = dp * M, micro-batch 1
COUNTS = [(zero, m) for zero in (1, 2) for m in (2, 4)]


def _count_case(_work_dir, zero: int, m: int) -> dict[str, int]:
    """FSDP2 collectives of the second step (the first also runs FSDP2's lazy init)."""
    from autopar.executor.parallel.apply import build_executable
    from autopar.executor.parallel.mesh import build_mesh
    from autopar.executor.runtime.checks import preflight
    from autopar.executor.runtime.train import rank_batch, train

    case = Case(name="count", model="gpt", parallel={"tp": 2, "dp": 2, "zero": zero}, global_batch_size=2 * m)
    plan = case.plan()
    from autopar.modelfile import load_model_file

    mf = load_model_file(plan.model.file)
    spec, _ = preflight(plan, mf, dist.get_world_size())
    exe = build_executable(plan, mf, spec, build_mesh(plan, torch.device("cpu")), seed=SEED, lr=1e-3,
                           loss_fn=mf.loss_fn)
    train(exe, mf, steps=1, seed=SEED)
    counts = {"all_gather": 0, "reduce_scatter": 0}
    originals = {"all_gather": dist.all_gather_single, "reduce_scatter": dist.reduce_scatter_single}

    def counting(kind: str):  # noqa: ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            counts[kind] += 1
            return originals[kind](*args, **kwargs)
        return call

    dist.all_gather_single = counting("all_gather")
    dist.reduce_scatter_single = counting("reduce_scatter")
    try:
        from autopar.executor.runtime.train import _Trainer

        _Trainer(exe, mf).step(rank_batch(exe, mf, 1, SEED))
    finally:
        dist.all_gather_single = originals["all_gather"]
        dist.reduce_scatter_single = originals["reduce_scatter"]
    return counts


COUNT_JOBS = share(4, [Job(name=f"zero1-count-z{zero}-m{m}", fn=_count_case, args=(zero, m)) for zero, m in COUNTS])


@pytest.mark.parametrize("case", EQUIVALENCE, ids=lambda c: c.name)
def test_zero1_gives_the_single_process_run(case: Case) -> None:
    got = result(4, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, ref_params, ref_grads = reference_for(case)
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: loss {a} vs reference {b}"
    for name, ref in ref_grads.items():
        tol = 1e-4 * float(ref.abs().max()) + 1e-7
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-3, atol=tol, msg=lambda m: f"grad {name}: {m}")
    for name, ref in ref_params.items():
        torch.testing.assert_close(got["params"][name], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert not any("ZeRO-2" in n for n in got["notes"]), got["notes"]


def test_zero1_collectives_per_step_do_not_grow_with_micro_batches() -> None:
    ranks = [result(4, job) for job in COUNT_JOBS]
    assert all(isinstance(r, list) for r in ranks), ranks
    z1_2, z1_4, z2_2, z2_4 = (r[0] for r in ranks)  # rank 0's counts
    assert z1_2 == z1_4, (z1_2, z1_4)  # once per step, whatever M
    assert z1_2["reduce_scatter"] > 0 and z1_2["all_gather"] > 0
    # ZeRO-2 reduce-scatters and re-gathers in every micro-batch: twice the calls at twice the M
    assert z2_4["reduce_scatter"] == 2 * z2_2["reduce_scatter"] == 4 * z1_2["reduce_scatter"]
    assert z2_4["all_gather"] == 2 * z2_2["all_gather"]
