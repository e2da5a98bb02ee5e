"""The parameters a tensor-parallel block leaves whole on every tp rank, placed by the block's data flow.

spec/tp_replicated.py reads off block 0 on meta which replicated parameters an op uses on a tp shard
(``TPPlan.flow``). Their local gradient covers this rank's heads or positions only, so they must be
summed over tp: a norm among them runs under DTensor's ``SequenceParallel`` (parameters replicated
DTensors, the local input taken as a shard), which sums it -- the residual-stream norms under SP,
and with or without SP a norm of the per-head q or k (Gemma 3, Qwen 3's ``q_norm``, which without SP
was trained on each rank's heads alone). Every other replicated parameter computes on whole tensors
and, since the colwise layers after it sum the heads' shares of its output gradient, gets the full
gradient on every rank: it stays a plain tensor, never summed (a sum would count it tp times).
Under SP such a layer inside a colwise layer's parent (multi-head latent attention's ``q_a_proj``,
``q_a_layernorm``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``) receives the parent's all-gathered
input, a replicated DTensor, which it takes as a plain whole tensor (``local_input_pre_hook``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from autopar.spec.sp_check import is_norm
from autopar.spec.tp_plan import TPPlan

__all__ = ["local_input_pre_hook", "summed_norms", "whole_modules"]


def summed_norms(block: nn.Module, plan: TPPlan, sequence_parallel: bool) -> tuple[str, ...]:
    """The norms run under ``SequenceParallel`` (gradient summed over tp): those the data flow shows
    computing on a tp shard. Without the data flow (``plan.flow`` None): every norm under SP, none
    without (the rule before the data flow was read)."""
    if plan.flow is not None:
        return plan.flow.shard_norms(sequence_parallel)
    return tuple(n for n, m in block.named_modules() if n and is_norm(m)) if sequence_parallel else ()


def whole_modules(block: nn.Module, plan: TPPlan, summed: tuple[str, ...]) -> tuple[str, ...]:
    """Under SP, the modules holding replicated parameters of their own that compute on whole
    tensors: neither a plan layer, nor ``summed``, nor one the data flow shows on the shard (a
    mixture of experts' router and experts, reduced by executor/parallel/expert_parallel.py)."""
    shard = {p.rpartition(".")[0] for p in plan.flow.on_shard_sp} if plan.flow is not None else set()
    skip = set(plan.styles) | set(summed) | shard
    return tuple(n for n, m in block.named_modules()
                 if n and n not in skip and any(True for _ in m.parameters(recurse=False)))


def _whole_local(value: Any) -> Any:
    if not isinstance(value, DTensor):
        return value
    if not all(p.is_replicate() for p in value.placements):
        raise RuntimeError(f"tensor parallelism: a replicated layer got a tensor placed {value.placements}")
    # its local gradient is taken as whole (Replicate): what reaches it is the full gradient on
    # every rank, the heads' shares summed by the colwise layers after it
    return value.to_local()


def local_input_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A replicated layer's all-gathered (replicated DTensor) inputs as plain whole tensors: its
    parameters are plain tensors, which DTensor does not mix with."""
    if not any(isinstance(v, DTensor) for v in tree_flatten((args, kwargs))[0]):
        return None
    return tree_map(_whole_local, args), tree_map(_whole_local, kwargs)
