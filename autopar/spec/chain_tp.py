"""Tensor-parallel plans for a chain of differing blocks: one plan per unit kind.

A chain (spec/chain.py) groups its units into kinds (``Chain.kinds``: one class, equal parameter
shapes and input shape). Each kind's plan is resolved by the precedence a repeated block's is
(spec/tp_plan.py): the model file's ``tp_plan`` (patterns relative to the unit, or model-relative
with a wildcard index), the model's own ``_tp_plan`` (Hugging Face writes ``layers.*`` patterns
that apply to every layer whatever its structure), then the kind's own data flow
(spec/tp_infer.py), read on the kind's first unit. The caller hands the resolver in
(``resolve_block``), so that a block and a chain unit go through one function.

A kind whose units hold no layer the executor can shard (no nn.Linear or HF Conv1D) stays
replicated: nothing of it is split, so every tp rank computing it whole is exact. A kind that holds
such layers and gets no plan refuses tensor parallelism for the whole chain (``chain_tp_reason``
names the first one), since a plan per kind is what the executor and the pricing read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from autopar.spec.chain import Chain
from autopar.spec.tp_plan import TPPlan, is_tp_linear

__all__ = ["KindPlan", "chain_kind_plans", "chain_sp_reason", "chain_tp_reason"]


@dataclass(frozen=True, kw_only=True)
class KindPlan:
    """The TP plan of one unit kind of a chain. ``kind``: the chain index of the kind's first unit
    (``Chain.kinds`` values); ``unit``: its dotted path; ``count``: the units of this kind;
    ``shardable``: whether the kind holds a layer the executor can shard; ``plan``: its styles are
    relative to the unit (empty: none found, ``plan.detail`` says why); ``inplace_outputs``: its
    rowwise layers whose output the unit's code modifies in place (spec/inplace.py)."""

    kind: int
    unit: str
    count: int
    shardable: bool
    plan: TPPlan
    inplace_outputs: tuple[str, ...] = ()
    runs: bool = True  # False: the forward skips the kind (Chain.skipped): nothing to shard or split
    # why sequence parallelism does not run this kind's first unit exactly (spec/sp_check.py); None:
    # it does. A kind without a plan has no SP check (it would compute on a sequence shard).
    sp_reason: str | None = "no tp plan"

    def describe(self) -> str:
        what = (self.plan.describe() if self.shardable else "replicated (no Linear layer to shard)" if self.runs
                else "replicated (the forward skips it)")
        return f"{self.unit} (x{self.count}): {what}"


def _shardable(unit: nn.Module) -> bool:
    return any(is_tp_linear(m) for m in unit.modules())


def chain_kind_plans(model: nn.Module, chain: Chain, resolve_block: Callable[[str, nn.Module], TPPlan],
                     inplace: Callable[[nn.Module, TPPlan], tuple[str, ...]],
                     sp: Callable[[nn.Module, TPPlan], str | None]) -> tuple[KindPlan, ...]:
    """One KindPlan per kind of ``chain``, in chain order. ``resolve_block(container, unit)``: the
    plan of ``unit`` (a child of the module list ``container``) by the block precedence; it is not
    called for a kind without a shardable layer. ``inplace(unit, plan)``: the unit's rowwise layers
    whose output its code modifies in place; ``sp(unit, plan)``: why SP does not run the unit
    exactly (None: it does); both called only for a kind with a plan."""
    out = []
    for k in sorted(set(chain.kinds)):
        path = chain.units[k]
        unit = model.get_submodule(path)
        runs = k not in chain.skipped  # a skipped kind stays replicated: it computes nothing
        shardable = runs and _shardable(unit)
        plan = resolve_block(path.rsplit(".", 1)[0], unit) if shardable else TPPlan(styles={}, source="none")
        out.append(KindPlan(kind=k, unit=path, count=chain.kinds.count(k), shardable=shardable, plan=plan,
                            inplace_outputs=inplace(unit, plan) if plan.styles else (),
                            sp_reason=sp(unit, plan) if plan.styles else ("no tp plan" if runs else None), runs=runs))
    return tuple(out)


def chain_tp_reason(kinds: tuple[KindPlan, ...]) -> str | None:
    """Why the chain's kinds do not all have a plan (one line naming the first that fails), or
    None when every kind holding a shardable layer has one."""
    for kp in kinds:
        if kp.shardable and not kp.plan.styles:
            return f"unit kind {kp.unit} ({kp.count} of the chain's units) has no tp plan: {kp.plan.detail or 'none found'}"
    if not any(kp.plan.styles for kp in kinds):
        return "no unit of the chain holds a layer tensor parallelism could shard"
    return None


def chain_sp_reason(kinds: tuple[KindPlan, ...]) -> str | None:
    """Why sequence parallelism does not run the chain exactly (one line), or None when every kind
    has a plan whose SP check passes (a unit's mixture of experts routes its rank's sequence shard:
    spec/sp_check.py). A kind left replicated would compute on its rank's sequence shard only."""
    for kp in kinds:
        if kp.runs and not kp.plan.styles:
            return f"unit kind {kp.unit} has no tp plan: under sequence parallelism it would see a sequence shard"
        if kp.sp_reason is not None:
            return f"unit kind {kp.unit}: {kp.sp_reason}"
    return None
