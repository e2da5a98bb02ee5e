"""Rehearse one rank of a plan: the real executor, one full training step, fake tensors.

``rehearse_rank`` makes this process rank ``r`` of the plan's world on a fake process group
(autopar.rehearse.fake), applies the plan with the executor's own code (``apply.shape_parts`` on
meta, then ``apply.place(fake=True)`` under fake tensors: TP/SP, CP, recompute, experts, ZeRO /
FSDP2, pipeline stages, the optimizer), and runs the training loop's own step (every micro-batch
of the schedule, its recompute, FSDP2's gathers, the optimizer step) twice: the first creates the
optimizer states and FSDP2's lazy state, the second runs under ``StepTracker`` and is what is
reported -- the steady step a real run repeats.

What a rehearsal cannot do: read tensor values. The training loop's check that a loss is next-token
cross-entropy (context parallelism) reads them, so it is skipped here (``autopar run`` makes it);
a model file whose forward reads values (``.item()``, data-dependent shapes) fails with one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from autopar.errors import AutoparError
from autopar.modelfile import ModelFile
from autopar.plan import Plan
from autopar.rehearse.fake import fake_rank, fake_tensors
from autopar.rehearse.tracker import StepTracker, peak_of


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """What one rank's rehearsed step held at its peak (bytes of tensors, no allocator slack)."""

    rank: int
    stage: int  # pipeline rank
    peak_bytes: float
    parts: dict[str, float]  # params, grads, optimizer, activations, temporaries
    seconds: float  # wall time of this rank's rehearsal


def rehearse_rank(plan: Plan, mf: ModelFile, spec: Any, rank: int) -> RankMemory:
    """Rehearse ``rank`` of ``plan`` (module docstring). ``spec``: the executor's ModelSpec of
    ``mf`` (``executor.checks.preflight``). Raises AutoparError (one line) where the executor
    cannot apply the plan or the model cannot run on fake tensors."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.executor.apply import place, shape_parts
    from autopar.executor.mesh import MESH_DIMS, ParallelMesh, rank_coords
    from autopar.executor.train import _Trainer

    start = time.perf_counter()
    par = plan.parallel
    device = torch.device("cpu")
    with fake_rank(rank, par.world_size):
        world = init_device_mesh(device.type, par.layout.shape, mesh_dim_names=MESH_DIMS)
        mesh = ParallelMesh(world=world, coords=rank_coords(rank, plan), device=device, plan=plan)
        shaped = shape_parts(plan, mf, spec, mesh, keep_first_chunk=True)
        batch = _rank_batch(plan, mf)
        with fake_tensors():
            try:
                exe = place(shaped, plan, mf, spec, mesh, seed=0, lr=1e-3, loss_fn=mf.loss_fn, fake=True)
                trainer = _Trainer(exe, mf)
                trainer.checked_cp_loss = True  # a value check (module docstring)
                trainer.step(batch)
                tracker = StepTracker()
                tracker.track_external(*exe.parts, exe.optimizer)
                with tracker:
                    trainer.step(batch)
            except AutoparError:
                raise
            except Exception as exc:  # the user's model on fake tensors, or the executor on this plan
                raise AutoparError(_one_line(mf, rank, exc)) from None
    peak = peak_of(tracker)
    return RankMemory(rank=rank, stage=mesh.coords.pp, peak_bytes=peak.peak_bytes, parts=peak.parts,
                      seconds=time.perf_counter() - start)


def _rank_batch(plan: Plan, mf: ModelFile) -> Any:
    """One rank's rows of a step (its dp share of the global batch), real and on the CPU: the
    training loop slices micro-batches from it (values are never read in a rehearsal)."""
    return mf.example_inputs(plan.training.global_batch_size // plan.parallel.dp, "cpu")


def _one_line(mf: ModelFile, rank: int, exc: Exception) -> str:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)):
        return (f"{mf.path}: the model reads tensor values during training ({first}), which a rehearsal on fake "
                "tensors cannot do; check its memory with 'autopar validate' on real ranks instead")
    return f"rank {rank}: the executor could not apply the plan at full scale: {type(exc).__name__}: {first}"
