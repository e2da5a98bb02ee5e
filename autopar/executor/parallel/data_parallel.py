"""Data parallelism and ZeRO over the ``dp x cp`` mesh (cp ranks see different tokens of the same
samples, so their gradients are averaged together with dp's).

Mechanisms (all real PyTorch parts):

======  =============================================================================================
zero    mechanism
======  =============================================================================================
0       ``DistributedDataParallel`` (bucketed all-reduce overlapped with backward). When the
        parameters are DTensors (tp > 1) DDP cannot take them, so FSDP2-style ``replicate`` is used:
        same semantics (replicated params, all-reduced grads) and it understands DTensor; it takes
        FSDP2's mixed-precision policy (bf16 compute copy, fp32 parameters and gradients).
1       FSDP2 ``fully_shard(reshard_after_forward=False)`` driven per step (``ZeroOneSync``, the
        training loop): gradient sync off and no resharding after backward on every micro-batch
        but the last, so the parameters are all-gathered once per step (first forward), the
        gradients accumulate unsharded (fp32) and are reduce-scattered once (last backward), and
        each rank's optimizer steps its 1/(dp cp) shard -- Megatron's distributed optimizer. At
        pp > 1 torch.distributed.pipelining's stage does the same switching itself. Works with
        and without DTensor (tp > 1) parameters.
2       FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients reduce-scattered (sharded) and
        optimizer states sharded in every micro-batch; the parameters gathered in forward are kept
        for backward (no second all-gather) and freed after it. This is PyTorch's documented
        ZeRO-2 equivalent (SHARD_GRAD_OP). (At pp > 1 the pipelining stage turns it into the
        ZeRO-1 behaviour above; the cost model prices it so, autopar.cost.zero.)
3       FSDP2 ``fully_shard`` per block and on the root (params, grads and states sharded; params
        re-gathered for backward).
======  =============================================================================================

0-d parameters (a learnable scalar gate or temperature): FSDP2 cannot shard them (it refuses to
wrap a module holding one, under ``replicate`` too), so they are left out of FSDP2
(``ignored_params``), stay whole on every rank and get their gradients averaged over the mesh by a
hook (``_average_grads_of``): a few bytes each, so ZeRO's savings are unchanged.

Mixed precision: FSDP2 and ``replicate`` get ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``
(the forward runs on one 16-bit copy of the parameters, its residual stream in 16 bits); DDP and an
unwrapped part (one data-parallel rank, no tp, no pipeline) run forward under ``torch.autocast``
(see train.py). fp32 keeps everything in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.executor.parallel import routed_grads
from autopar.torch_dtypes import TORCH_DTYPES


@dataclass(frozen=True, kw_only=True)
class DataParallelResult:
    """What the training loop needs to know about how a part was wrapped."""

    module: nn.Module
    kind: str  # "none" | "ddp" | "replicate" | "fsdp"
    sharded_optimizer: bool  # True: build ZeroRedundancyOptimizer (no plan does any more; kept for callers)
    zero1: bool = False  # FSDP2 as ZeRO-1: the training loop syncs gradients on the last micro-batch only


def _has_dtensor(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def uses_fsdp(zero: int, dp_size: int) -> bool:
    """Whether ``apply_data_parallel`` wraps with FSDP2's ``fully_shard`` (ZeRO 2 and 3; ZeRO 1
    over more than one rank)."""
    return zero >= 2 or (zero == 1 and dp_size > 1)


# The wraps that cast through FSDP2's MixedPrecisionPolicy; the others train under autocast (train.py)
MIXED_PRECISION_KINDS = ("fsdp", "replicate")


def wrap_kind(zero: int, dp_size: int, *, replicated: bool) -> str:
    """How ``apply_data_parallel`` wraps a part: "fsdp" (``uses_fsdp``), "replicate"
    (``replicated``: DTensor parameters or a pipeline stage, which DDP cannot take -- on one
    data-parallel rank too, for its mixed-precision policy: unwrapped, such a part trained under
    autocast, each Linear saving a 16-bit copy of its weight per micro-batch in flight, 122 GiB on
    the first stage of GPT-3's Megatron layout), "none" (one data-parallel rank, neither) or "ddp".
    The cost model prices the same rule from a plan's degrees (``autopar.cost.framework.dp_wrapper``:
    planner code does not import the executor)."""
    if uses_fsdp(zero, dp_size):
        return "fsdp"
    if replicated:
        return "replicate"
    return "none" if dp_size == 1 else "ddp"


def apply_data_parallel(
    part: nn.Module,
    blocks: Iterable[nn.Module],
    mesh: DeviceMesh,
    *,
    zero: int,
    dtype: str,
    device: torch.device,
    pipelined: bool = False,
    offload_policy: object | None = None,
    ddp_stand_in: bool = False,
    fill: Callable[[nn.Module], None] | None = None,
    host_masters: bool = False,
    unused_params: bool = False,
    routed: bool = False,
) -> DataParallelResult:
    """Wrap ``part`` (real tensors, already TP/CP/recompute-applied) for data parallelism.

    ``pipelined``: ``part`` is a pipeline stage. Its schedule runs several forwards before their
    backwards (1F1B warm-up), which DDP's reducer cannot follow (its first iteration rebuilds the
    buckets from one forward's parameter order and asserts on the second), so ZeRO-0 stages use
    FSDP2's ``replicate``, whose gradient sync the pipelining stage drives as it does FSDP2's.

    ``offload_policy`` (host offload): FSDP2's ``CPUOffloadPolicy`` for ZeRO-3 parameter offload
    (executor/parallel/offload.py), given to every ``fully_shard``.

    ``ddp_stand_in`` (a rehearsal on fake tensors, autopar.rehearse): ``DDPBuckets`` instead of
    DDP, whose C++ reducer needs real storage; everything else is wrapped as in a run.

    ``fill`` (FSDP2 kinds, ``apply.sharded_fill``): ``part`` is still on meta; ``fill(m)`` gives
    block ``m`` (or, for ``part``, what lies outside the blocks) its storage and values, called
    just before that module is sharded, so at most the root's parameters and one block are whole
    on the device at once (an 80 GB GPU cannot hold a ZeRO-3 plan's stage unsharded).

    ``host_masters`` (optimizer offload, executor/parallel/offload.py ``HostOptimizer``): the fp32 masters
    live on the host, so an FSDP2 part's sharded parameters -- and with them their gradients, which
    FSDP2 reduces in fp32 and stores in the parameter's dtype -- are held on the device in the
    training dtype, as ZeRO-Offload and Megatron-LM's CPU optimizer do: 2 + 2 bytes per sharded
    parameter instead of 4 + 4, what autopar.cost.offload prices. Each module is cast just before
    it is sharded; a ``replicate`` part whole, before it is wrapped.

    ``unused_params``: some trainable parameters get no gradient from the loss (spec/unused.py); DDP
    then follows the autograd graph each step to mark them ready (``find_unused_parameters``), else
    the bucket holding one would never reduce.

    ``routed`` (spec.routed: a router picks experts by the data): the parameters with a gradient
    differ from rank to rank (an expert that no token of this rank chose runs no backward here, HF
    Switch Transformers). DDP then finds unused parameters each step; under FSDP2 and ``replicate``
    the ranks agree on the set before each reduction (executor/parallel/routed_grads.py), else each
    would reduce a different set of gradients and the collective's sizes would not match."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[dtype], reduce_dtype=torch.float32) if dtype != "fp32" else MixedPrecisionPolicy()
    kind = wrap_kind(zero, mesh.size(), replicated=pipelined or _has_dtensor(part))
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        reshard = zero == 3
        blocks = list(blocks)
        extra = {"offload_policy": offload_policy} if offload_policy is not None else {}  # host offload
        if fill is not None:
            fill(part)  # the root's own parameters (embedding, head, norms), sharded last
        stored = TORCH_DTYPES[dtype] if host_masters and dtype != "fp32" else None
        if stored is not None:  # optimizer offload: the root's own parameters, before blocks are sharded
            in_blocks = {id(p) for block in blocks for p in block.parameters()}
            _cast_parameters(part, stored, lambda p: id(p) not in in_blocks)

        # Modules whose parameters several blocks share (Zamba2's shared attention block, tied into
        # every hybrid layer) form one FSDP group first: FSDP2 refuses a parameter in two groups.
        shared = shared_module_groups(blocks)
        for block in blocks:
            if fill is not None:
                fill(block)
            if stored is not None:
                _cast_parameters(block, stored, lambda p: True)
            for group in [g for g in shared if any(m is g[0] for m in block.modules())]:
                fully_shard(group, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, **_without_scalars(group[0], extra))
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, **_without_scalars(block, extra))
        # Root: FSDP2's default (None) keeps the root's parameters gathered from forward to backward,
        # which comes right after -- re-gathering them would only add an all-gather.
        fully_shard(part, mesh=mesh, reshard_after_forward=None if reshard else False, mp_policy=mp, **_without_scalars(part, extra))
        _average_grads_of([p for p in part.parameters() if p.dim() == 0], mesh)
        if routed:
            routed_grads.install(part, mesh.get_group(), device)
        return DataParallelResult(module=part, kind="fsdp", sharded_optimizer=False, zero1=zero == 1)
    if kind == "none":
        return DataParallelResult(module=part, kind="none", sharded_optimizer=False)
    if kind == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        # FSDP2's mixed precision, not autocast: autocast over fp32 parameters kept a 16-bit copy
        # of every weight per micro-batch and an fp32 residual stream (rehearsed 15-26 % above
        # the price of Llama-3 70B's ZeRO-0 plan at 64 H100s).
        # One unit per block, then the root, as fully_shard's: a unit's 16-bit gradients live until
        # its backward ends and its fp32 reduce input until the next unit's reduce, so a whole-stage
        # unit held a pipeline chunk of each at the peak (GPT-3's Megatron layout at dp 2 rehearsed
        # 5 % over its price), and its all-reduce could only start once the whole stage's backward
        # had run.
        blocks = list(blocks)
        if host_masters and dtype != "fp32":  # optimizer offload: as for FSDP2 above, 16-bit device parameters
            _cast_parameters(part, TORCH_DTYPES[dtype], lambda p: True)
        for group in shared_module_groups(blocks):
            replicate(group, mesh=mesh, mp_policy=mp, **_without_scalars(group[0], {}))
        for block in blocks:
            replicate(block, mesh=mesh, mp_policy=mp, **_without_scalars(block, {}))
        replicate(part, mesh=mesh, mp_policy=mp, **_without_scalars(part, {}))
        _average_grads_of([p for p in part.parameters() if p.dim() == 0], mesh)
        if routed:
            routed_grads.install(part, mesh.get_group(), device)
        return DataParallelResult(module=part, kind="replicate", sharded_optimizer=False)
    if ddp_stand_in:
        return DataParallelResult(module=DDPBuckets(part), kind="ddp", sharded_optimizer=False)
    # gradient_as_bucket_view stays off: with it the MLP's dp2 equivalence run grew to 14 GB RSS
    # (OOM) on torch 2.13 CPU; DDP's bucket copy of the gradients is priced instead (cost/stage.py).
    ddp = nn.parallel.DistributedDataParallel(
        part,
        process_group=mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=False,
        find_unused_parameters=unused_params or routed,
    )
    return DataParallelResult(module=ddp, kind="ddp", sharded_optimizer=False)


class DDPBuckets(nn.Module):
    """What ``DistributedDataParallel`` holds beside the module, for a rehearsal on fake tensors:
    its gradient buckets. DDP's reducer allocates, at construction, one flat bucket per group of
    parameters covering every trainable parameter, in the parameter's dtype (with
    ``gradient_as_bucket_view`` off, as here, beside the ``.grad`` tensors): held as a buffer, so
    a memory tracker counts it. ``module`` and ``no_sync`` are DDP's names; the all-reduce itself
    is left out (it allocates nothing)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        trainable = [p for p in module.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, int] = {}
        for p in trainable:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        for i, (dtype, numel) in enumerate(by_dtype.items()):
            self.register_buffer(f"ddp_buckets_{i}", torch.empty(numel, dtype=dtype, device=trainable[0].device),
                                 persistent=False)

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self.module(*args, **kwargs)

    def no_sync(self):  # noqa: ANN201
        from contextlib import nullcontext

        return nullcontext()


def shared_module_groups(blocks: list[nn.Module]) -> list[list[nn.Module]]:
    """Groups of modules, in different blocks, holding the same parameters (a block tied into several
    depths): in each block the outermost modules all of whose parameters another block also holds,
    grouped by their parameter set; the first group member lies in the earliest block."""
    holders: dict[int, set[int]] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            holders.setdefault(id(p), set()).add(i)
    shared = {pid for pid, where in holders.items() if len(where) > 1}
    if not shared:
        return []
    groups: dict[frozenset[int], list[nn.Module]] = {}
    for block in blocks:
        taken: list[nn.Module] = []
        for m in block.modules():
            ids = frozenset(id(p) for p in m.parameters())
            if not ids or not ids <= shared or any(any(m is d for d in t.modules()) for t in taken):
                continue
            taken.append(m)
            groups.setdefault(ids, []).append(m)
    return [g for g in groups.values() if len(g) > 1]


def _without_scalars(module: nn.Module, extra: dict[str, Any]) -> dict[str, Any]:
    """``fully_shard`` / ``replicate`` keyword arguments for ``module``: its 0-d parameters (a learnable
    scale, CLIP's ``logit_scale``), which FSDP2 refuses to manage under either, left out -- kept whole
    and averaged over the mesh by hooks (``_average_grads_of``) -- with ``extra``."""
    scalars = {p for p in module.parameters() if p.dim() == 0}
    return {"ignored_params": scalars, **extra} if scalars else dict(extra)


def _average_grads_of(params: list[nn.Parameter], mesh: DeviceMesh) -> list[nn.Parameter]:
    """Average each parameter's gradient over ``mesh`` as soon as it is accumulated (the parameters
    FSDP2 leaves out). Averaging after every micro-batch is exact: what earlier micro-batches left in
    ``.grad`` is already equal on every rank, so averaging it again keeps it."""
    import torch.distributed as dist

    group, n = mesh.get_group(), mesh.size()

    def hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(n)

    trainable = [p for p in params if p.requires_grad]
    for p in trainable:
        p.register_post_accumulate_grad_hook(hook)
    return list(params)


def sync_every_microbatch(stage_module: nn.Module) -> None:
    """ZeRO-3 under a pipeline schedule keeps ZeRO-3's memory. torch.distributed.pipelining's stage
    turns an FSDP module's gradient sync and its resharding after backward off before every
    micro-batch's backward and reduces once, after the step's last (``perform_reduce_grad``): right
    for ZeRO-1/2 (one reduce-scatter per step), but under ZeRO-3 it holds the stage's whole fp32
    gradients and, between a backward and the next forward, its whole gathered parameters --
    ZeRO-1's memory, which is not what a plan asks for when it asks for ZeRO-3 (nor what the cost
    model prices). So on a ZeRO-3 stage module the stage's two switches are no-ops: each
    micro-batch's backward reduce-scatters its gradients into the shards and frees the block's
    gathered parameters, as FSDP2 does without a pipeline, and the stage's final reduce finds
    nothing left to reduce (FSDP2's post_backward is idempotent)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(stage_module, FSDPModule):
        keep = lambda *args, **kwargs: None  # noqa: E731
        stage_module.set_requires_gradient_sync = keep  # type: ignore[method-assign]
        stage_module.set_reshard_after_backward = keep  # type: ignore[method-assign]


def _cast_parameters(module: nn.Module, dtype: torch.dtype, chosen: Callable[[nn.Parameter], bool]) -> None:
    """Floating-point parameters of ``module`` that ``chosen`` picks, cast to ``dtype`` in place
    (the Parameter objects stay, so tied weights stay tied; buffers are left alone). A tensor-parallel
    (DTensor) parameter has its contents swapped: assigning ``.data`` to a DTensor parameter
    changes the dtype it reports but not its local shard's, which FSDP2 shards from -- a
    vocabulary-parallel embedding stayed fp32 beside bf16 parameters, and FSDP2 refused the group
    (GPT-3's top plan at 64 H100s, optimizer offload with tp 4 and pp 8)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype and chosen(p):
                if isinstance(p, DTensor):
                    torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))
                else:
                    p.data = p.data.to(dtype)


def zero1_microbatch(module: nn.Module, last: bool) -> None:
    """Before micro-batch i of a step on a ZeRO-1 FSDP2 module: on all but the last, no gradient
    reduce-scatter (FSDP2 accumulates the unsharded gradient in its reduce dtype) and no resharding
    after backward (the next forward finds the parameters gathered); on the last, both back on, so
    the step's one reduce-scatter runs and the parameters are freed for the optimizer to update
    their shards (the next step's first forward gathers them again)."""
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(module, FSDPModule), "ZeRO-1 parts are FSDP2 modules"
    module.set_requires_gradient_sync(last)
    module.set_reshard_after_backward(last)


def replicate_microbatch(module: nn.Module, last: bool) -> None:
    """Before micro-batch i of a step on a ``replicate`` part without a pipeline: gradient sync on
    the last only (DDP's ``no_sync`` before it), so the step all-reduces its gradients once, block
    by block behind the last backward, as the cost model prices ZeRO-0 -- not once per micro-batch.
    Until then each unit accumulates its unsharded gradients in the reduce dtype (fp32), the
    gradient memory ``replicate`` holds anyway. (At pp > 1 the pipelining stage switches it.)"""
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(module, FSDPModule), "replicate parts are FSDP2 modules"
    module.set_requires_gradient_sync(last)


def build_optimizer(
    params: list[nn.Parameter], name: str, lr: float, sharded: bool, mesh: DeviceMesh | None
) -> torch.optim.Optimizer:
    """AdamW (adam/adamw in the plan) or SGD; ZeRO-1 wraps it in ZeroRedundancyOptimizer."""
    cls: Callable[..., torch.optim.Optimizer]
    kwargs: dict = {"lr": lr}
    if name == "sgd":
        cls = torch.optim.SGD
    else:
        cls = torch.optim.AdamW
        kwargs["weight_decay"] = 0.01
    if sharded and mesh is not None and mesh.size() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=mesh.get_group(), **kwargs)
    return cls(params, **kwargs)
