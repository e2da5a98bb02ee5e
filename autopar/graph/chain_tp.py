"""A chain of differing blocks measured under its TP plans per unit kind (spec/chain_tp.py).

What graph/build.py and spec/tp_shard.py do for one repeated block, for each unit the chain's
measurement runs (graph/chain_measure.py): ``shard_chain_for_tp`` is one tp rank's meta copy of the
cut chain model (every run unit's planned Linear layers at 1/tp of their width, its ``local_attrs``
divided, the vocabulary edges sharded as the executor shards them), whose trace gives the t
exponents of each unit's region; ``chain_tp_comm_hooks`` records each unit's TP collectives in its
own region (forward: an all-reduce of each rowwise output; backward: one of each distinct colwise
input's gradient), whatever tp is, as the executor's DTensor plan issues them.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from autopar.graph.trace import Trace
from autopar.spec.tp_plan import TPPlan, is_tp_linear
from autopar.spec.tp_shard import shard_block_for_tp, shard_for_tp

__all__ = ["chain_tp_comm_hooks", "shard_chain_for_tp", "sharded_params"]


def shard_chain_for_tp(small: nn.Module, container: str, plans: Sequence[TPPlan], tp: int, *,
                       vocab_constants: bool = False) -> nn.Module:
    """A meta copy of ``small`` (the chain model cut to the units it runs, one module list at
    ``container``) as one tp rank holds it: unit j sharded by ``plans[j]``, the edges by vocabulary."""
    sharded = shard_for_tp(small, container, {}, tp, vocab_constants=vocab_constants)  # the edges only
    # units left in their places unrun (chain_measure.PassThrough) hold nothing to shard
    units = [u for u in sharded.get_submodule(container) if not getattr(u, "passes_through", False)]
    if len(units) != len(plans):
        raise ValueError(f"{len(plans)} plans for {len(units)} units of {container}")
    for unit, plan in zip(units, plans):
        if plan.styles:
            shard_block_for_tp(unit, plan.styles, tp, plan.local_attrs)
    return sharded


def sharded_params(unit: nn.Module, plan: TPPlan) -> int:
    """Parameters of ``unit`` that its plan divides over tp ranks: a colwise layer's weight and
    bias, a rowwise layer's weight (its bias is added once, after the reduction)."""
    n = 0
    for name, style in plan.styles.items():
        mod = unit.get_submodule(name)
        if not is_tp_linear(mod):
            continue
        n += mod.weight.numel()
        bias = getattr(mod, "bias", None)
        if style == "colwise" and isinstance(bias, torch.Tensor):
            n += bias.numel()
    return n


def chain_tp_comm_hooks(units: Sequence[nn.Module], plans: Sequence[Mapping[str, str]], trace: Trace) -> list:
    """Hooks recording unit j's TP collectives in region ``unit.j`` (module docstring)."""
    handles = []
    for j, (unit, styles) in enumerate(zip(units, plans)):
        region = f"unit.{j}"
        seen: set[int] = set()

        def on_rowwise(mod: nn.Module, args: tuple, out: torch.Tensor, region: str = region) -> None:
            trace.comm.append((region, "fwd", "tp_allreduce", float(out.numel() * out.element_size())))

        def on_colwise(mod: nn.Module, args: tuple, region: str = region, seen: set[int] = seen) -> None:
            x = args[0]
            if id(x) not in seen:  # q, k and v reading one input need one all-reduce
                seen.add(id(x))
                trace.comm.append((region, "bwd", "tp_allreduce", float(x.numel() * x.element_size())))

        for name, style in styles.items():
            mod = unit.get_submodule(name)
            if not is_tp_linear(mod):
                continue
            if style == "rowwise":
                handles.append(mod.register_forward_hook(on_rowwise))
            else:
                handles.append(mod.register_forward_pre_hook(on_colwise))
    return handles
