"""Gradients of routed experts under FSDP2 (ZeRO 1-3) and ``replicate``: the same set on every rank.

A router picks experts by the data, and a mixture of experts that runs only the experts its tokens
chose (HF Switch Transformers loops over ``mask.sum(...).nonzero()``) leaves an expert no token of
this rank chose without a gradient here, while another rank has one. FSDP2 reduce-scatters the
gradients a rank has, so the ranks would pass collectives of different sizes (gloo: "Received data
size doesn't match expected size"). Before each reduction, ``install`` has the ranks agree, with one
all-reduce of a flag per parameter of the group: a parameter with a gradient on any rank gets zeros
where it has none (the sum is then the sum over the ranks that used it); one that no rank used stays
without a gradient everywhere, so the optimizer skips it as one rank would (torch's own
``set_reduce_scatter_unused_params`` would hand it zeros, and AdamW would still move it by its
momentum). Installed only for models the spec saw route (``spec.routed``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn


def fsdp_param_groups(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of ``module`` and its submodules (each once)."""
    from torch.distributed.fsdp import FSDPModule

    groups: list[Any] = []
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:  # torch before per-parameter-mesh groups: one optional group
            one = getattr(state, "_fsdp_param_group", None)
            found = [one] if one is not None else []
        groups.extend(g for g in found if all(g is not h for h in groups))
    return groups


def _agree(group: Any, original: Callable[..., Any], process_group: Any, device: torch.device, *args: Any) -> Any:
    if getattr(group, "reduce_grads", True):
        params = [fp for fp in group.fsdp_params
                  if hasattr(fp, "_unsharded_param") and fp.unsharded_param.requires_grad]
        mine = [fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None for fp in params]
        if params:
            flags = torch.tensor(mine, dtype=torch.int32, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=process_group)
            for fp, has, anyone in zip(params, mine, flags.tolist()):
                if anyone and not has:
                    fp.unsharded_param.grad = torch.zeros_like(fp.unsharded_param)
    return original(*args)


def install(module: nn.Module, process_group: Any, device: torch.device) -> None:
    """Wrap each FSDP2 group's ``post_backward`` of ``module`` (see the module docstring)."""
    for group in fsdp_param_groups(module):
        group.post_backward = functools.partial(_agree, group, group.post_backward, process_group, device)
