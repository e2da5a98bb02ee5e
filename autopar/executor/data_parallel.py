"""Data parallelism and ZeRO over the ``dp x cp`` mesh (cp ranks see different tokens of the same
samples, so their gradients are averaged together with dp's).

Mechanisms (all real PyTorch parts):

======  =============================================================================================
zero    mechanism
======  =============================================================================================
0       ``DistributedDataParallel`` (bucketed all-reduce overlapped with backward). When the
        parameters are DTensors (tp > 1) DDP cannot take them, so FSDP2-style ``replicate`` is used:
        same semantics (replicated params, all-reduced grads) and it understands DTensor.
1       DDP for the gradients + ``ZeroRedundancyOptimizer`` (AdamW states sharded over dp x cp;
        each rank steps its shard and broadcasts the updated parameters).
2       FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients reduce-scattered (sharded) and
        optimizer states sharded; the parameters gathered in forward are kept for backward (no
        second all-gather). This is PyTorch's documented ZeRO-2 equivalent (SHARD_GRAD_OP).
3       FSDP2 ``fully_shard`` per block and on the root (params, grads and states sharded; params
        re-gathered for backward).
======  =============================================================================================

Mixed precision: FSDP2 gets ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``; the other
paths run forward under ``torch.autocast`` (see train.py). fp32 keeps everything in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class DataParallelResult:
    """What the training loop needs to know about how a part was wrapped."""

    module: nn.Module
    kind: str  # "none" | "ddp" | "replicate" | "fsdp"
    sharded_optimizer: bool  # True: build ZeroRedundancyOptimizer


def _has_dtensor(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def apply_data_parallel(
    part: nn.Module,
    blocks: Iterable[nn.Module],
    mesh: DeviceMesh,
    *,
    zero: int,
    dtype: str,
    device: torch.device,
) -> DataParallelResult:
    """Wrap ``part`` (real tensors, already TP/CP/recompute-applied) for data parallelism."""
    if zero >= 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32) if dtype != "fp32" else MixedPrecisionPolicy()
        reshard = zero == 3
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        # Root: FSDP2's default (None) keeps the root's parameters gathered from forward to backward,
        # which comes right after -- re-gathering them would only add an all-gather.
        fully_shard(part, mesh=mesh, reshard_after_forward=None if reshard else False, mp_policy=mp)
        return DataParallelResult(module=part, kind="fsdp", sharded_optimizer=False)
    if mesh.size() == 1:
        return DataParallelResult(module=part, kind="none", sharded_optimizer=False)
    if _has_dtensor(part):
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(part, mesh=mesh)
        return DataParallelResult(module=part, kind="replicate", sharded_optimizer=zero == 1)
    # gradient_as_bucket_view stays off: with it the MLP's dp2 equivalence run grew to 14 GB RSS
    # (OOM) on torch 2.13 CPU; DDP's bucket copy of the gradients is priced instead (cost/stage.py).
    ddp = nn.parallel.DistributedDataParallel(
        part,
        process_group=mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=False,
    )
    return DataParallelResult(module=ddp, kind="ddp", sharded_optimizer=zero == 1)


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
