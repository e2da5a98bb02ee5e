"""Rehearse one rank of a plan: the real executor, one full training step, fake tensors.

``rehearse_step`` makes this process rank ``r`` of the plan's world on a fake process group
(autopar.rehearse.fake), applies the plan with the executor's own code (``apply.shape_parts`` on
meta, then ``apply.place(fake=True)`` under fake tensors: TP/SP, CP, recompute, experts, ZeRO /
FSDP2, pipeline stages, the optimizer), and runs the training loop's own step (every micro-batch
of the schedule, its recompute, FSDP2's gathers, the optimizer step) under ``StepTracker``, after
one optimizer step on zero gradients has created the optimizer's states: the steady step a real
run repeats, whose forward already finds the states there.

A step's peak stops growing with its micro-batches once the schedule is full, except for what the
schedule keeps per micro-batch (torch.distributed.pipelining allocates a receive buffer for every
micro-batch of a step, activations forward and gradients backward, and keeps them). So a rehearsal
runs as many micro-batches as reach the peak, not the plan's hundreds (``rehearsed_microbatches``):
without a pipeline, the first, a middle and the last (the first has no gradients yet, the last
reduces them); with a pipeline, two counts M1 < M2 = M1 + pp at which every rank's schedule reaches
its steady state, and the peak at the plan's M is the line through the two (affine in M from there
on: only the per-micro-batch buffers grow); GPipe holds every micro-batch, so it runs them all.

Steady means more than full. 1F1B (v = 1) is full by 2 pp (at most pp - r micro-batches in flight).
Interleaved 1F1B (torch's ``ScheduleInterleaved1F1B``: a warm-up of (v - 1) pp + 2 (pp - 1 - r)
chunk forwards, then one forward and one backward per step, backwards walking the local chunks
last to first a round of pp micro-batches each) reaches the state it then repeats only once its
1F1B phase has run a round on every local chunk: each chunk has then made its unsharded fp32
gradient (ZeRO-1 accumulates it), and the schedule's prefetch window (``_add_unshard_reshard``,
three chunks gathered at a time) has cycled. Below that the peak depends on which chunks happen
to be gathered, not on M, and a line through two such counts runs away: at pp 4, v 4, counts
(8, 12) put Llama-3 70B's gathered parameters at twice the whole stage, where a step of the
plan's 32 holds three quarters of it. So M1 is the least multiple of pp (at least 2 pp) with
v M1 - warm-up(rank 0) >= v pp.

Kernels: for a GPU profile the step runs the kernels the GPU would where a CPU's save other tensors
for backward (dropout's mask, SDPA: ``_target_device_functions``); for a CPU profile, the CPU's.

What a rehearsal cannot do: read tensor values. The training loop's check that a loss is next-token
cross-entropy (context parallelism) reads them, so it is skipped here (``autopar run`` makes it);
a model file whose forward reads values (``.item()``, data-dependent shapes) fails with one line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from autopar.errors import AutoparError
from autopar.modelfile import ModelFile
from autopar.plan import Plan
from autopar.rehearse.fake import fake_rank, fake_tensors
from autopar.rehearse.tracker import PeakMemory, StepTracker, peak_of


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """What one rank's rehearsed step held at its peak (bytes of tensors, no allocator slack)."""

    rank: int
    stage: int  # pipeline rank
    peak_bytes: float
    parts: dict[str, float]  # params, grads, optimizer, activations, temporaries (device), host
    seconds: float  # wall time of this rank's rehearsal
    microbatches: tuple[int, ...]  # the micro-batches of each rehearsed step (module docstring)
    origins: tuple = ()  # why.LiveGroup at the (last rehearsed step's) peak, with ``rehearse --why``


def rehearsed_microbatches(plan: Plan) -> tuple[int, ...]:
    """Micro-batches of each step a rehearsal runs to find the plan's peak (module docstring):
    one count, or two for the line through them."""
    par, m = plan.parallel, plan.num_microbatches
    if par.pp == 1:
        return (min(m, 3),)
    if par.pp_schedule == "gpipe":
        return (m,)
    first = steady_microbatches(par.pp, par.pp_virtual_stages if par.pp_schedule == "interleaved-1f1b" else 1)
    if m <= first + par.pp:
        return (m,)
    return (first, first + par.pp)  # multiples of pp, as interleaved 1F1B needs


def steady_microbatches(pp: int, v: int) -> int:
    """The least micro-batches per step at which every pipeline rank's 1F1B or interleaved 1F1B
    schedule (``v`` local chunks) is in the state it repeats (module docstring): 2 pp, or the
    least multiple of pp whose 1F1B phase on rank 0 (the longest warm-up) runs a round of pp
    micro-batches on each of its v chunks."""
    warmup = (v - 1) * pp + 2 * (pp - 1)  # torch's interleaved warm-up, rank 0
    m = 2 * pp
    while v > 1 and v * m - warmup < v * pp:
        m += pp
    return m


def with_microbatches(plan: Plan, m: int) -> Plan:
    """``plan`` with a global batch of ``m`` micro-batches."""
    if m == plan.num_microbatches:
        return plan
    gbs = m * plan.training.micro_batch_size * plan.parallel.dp
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, global_batch_size=gbs))


def rank_memory(plan: Plan, rank: int, peaks: list[PeakMemory], seconds: float) -> RankMemory:
    """``rank``'s memory at the plan's micro-batches from its rehearsed steps (one per count of
    ``rehearsed_microbatches``): the one, or the line through the two."""
    counts = rehearsed_microbatches(plan)
    peak = peaks[0]
    if len(peaks) == 2:
        (m1, m2), m = counts, plan.num_microbatches
        at = lambda a, b: a + (b - a) * (m - m1) / (m2 - m1)  # noqa: E731
        peak = PeakMemory(peak_bytes=at(peaks[0].peak_bytes, peaks[1].peak_bytes),
                          parts={k: at(v, peaks[1].parts[k]) for k, v in peaks[0].parts.items()})
    return RankMemory(rank=rank, stage=plan.parallel.layout.coords(rank).pp, peak_bytes=peak.peak_bytes,
                      parts=peak.parts, seconds=seconds, microbatches=counts, origins=peaks[-1].origins)


def rehearse_step(plan: Plan, mf: ModelFile, spec: Any, rank: int, why: int = 0) -> PeakMemory:
    """The peak of one tracked training step of ``rank`` (``plan`` as given). Brings up a fake world
    of its own: torch keeps process-group state per process (DeviceMesh's caches hold group names),
    so call it once per process (autopar.rehearse.compare runs each in a fresh one). ``why`` > 0:
    also the ``why`` largest groups of tensors alive at the peak, by origin (autopar.rehearse.why)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.executor.parallel.apply import place, shape_parts
    from autopar.executor.parallel.mesh import MESH_DIMS, ParallelMesh, rank_coords
    from autopar.executor.runtime.train import _Trainer
    from autopar.rehearse.why import WhyTracker, top_groups

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
                _create_optimizer_states(exe)
                tracker = (WhyTracker if why else StepTracker)(**_host_resident(plan, exe))
                tracker.track_external(*exe.parts, exe.optimizer)
                if plan.parallel.offload.optimizer or plan.parallel.offload.params:
                    _step_on_host(exe.optimizer, tracker)
                with tracker, _target_device_functions(plan):
                    trainer.step(batch)
            except AutoparError:
                raise
            except Exception as exc:  # the user's model on fake tensors, or the executor on this plan
                raise AutoparError(_one_line(mf, rank, exc)) from None
    peak = peak_of(tracker)
    return dataclasses.replace(peak, origins=top_groups(tracker, why)) if why else peak


def _target_device_functions(plan: Plan) -> Any:
    """The kernels the plan's GPUs run where a CPU's differ in what they save for backward: on a
    GPU profile the step runs under the trace's function mode (graph/trace.py
    ``cuda_like_functions_everywhere``, backward's recompute included): dropout keeps CUDA's
    1-byte mask, not the CPU kernel's mask in the activation dtype (GPT-3's attention dropout: 128
    MiB a layer at 2,048 tokens), and SDPA runs the flash kernel CUDA picks. A CPU profile's plan
    runs the CPU's own kernels, as its real run does (the rehearsal then equals that run,
    tests/dist/test_rehearse.py)."""
    import contextlib

    from autopar.cluster import load_cluster
    from autopar.graph.trace import cuda_like_functions_everywhere
    from autopar.profile_conditions import profile_conditions

    conditions = profile_conditions(load_cluster(plan.cluster.profile))
    if conditions is not None and conditions.device_type == "cpu":
        return contextlib.nullcontext()
    return cuda_like_functions_everywhere()


def _host_resident(plan: Plan, exe: Any) -> dict[str, Any]:
    """What a real run of ``plan`` keeps on the host (executor/parallel/offload.py), as StepTracker takes it:
    FSDP2's parameter offload holds the sharded parameters, their gradients and the optimizer on the
    host; optimizer offload (HostOptimizer) its states (and fp32 masters, built before the step and
    not tracked). Activation offload's copies are not told apart: they count on the device."""
    off = plan.parallel.offload
    labels: tuple[str, ...] = ()
    params = 0.0
    if off.params:
        labels = ("Gradient", "Optstate")
        for part in exe.parts:
            for p in part.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                params += local.untyped_storage().nbytes()
    elif off.optimizer:
        labels = ("Optstate",)
    return {"host_labels": labels, "host_param_bytes": params}


def _step_on_host(optimizer: Any, tracker: StepTracker) -> None:
    """Under optimizer or parameter offload the update runs on the CPU: what its step allocates is
    host memory in a real run, so the rehearsal's tracker leaves it out of the device peak
    (``StepTracker.off_device``; on a rehearsal's CPU device the two cannot be told apart)."""
    step = optimizer.step

    def on_host(*args: Any, **kwargs: Any) -> Any:
        with tracker.off_device():
            return step(*args, **kwargs)

    optimizer.step = on_host


def _create_optimizer_states(exe: Any) -> None:
    """One optimizer step on zero gradients: the states a real run's first step creates (Adam's
    moments, the host optimizer's copies), without running the model a second time."""
    for part in exe.parts:
        for p in part.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    exe.optimizer.step()
    exe.optimizer.zero_grad(set_to_none=True)


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
