"""Which tensor-parallel degrees run on a model (autopar.layout.TPDegrees), found on meta.

What differs from one degree to the next is one rank's share of the block: its heads, its slice of
each planned layer, a fused projection's parts. The shape rules (heads and widths divisible by tp)
are read from the spec; then block 0 (a chain read as one list: one unit of each kind) is run on
meta at one rank's width (spec/tp_shard.py, what the planner's own tp trace builds) for every
degree those rules allow, once per degree, with the arguments the model's forward handed it. A
degree whose block fails is refused with the error's first line. The planner's search, ``autopar
estimate`` and the executor's preflight all read the result (``ModelSpec.tp_degrees``, copied into
the graph), so none offers a degree another refuses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from autopar.layout import TPDegrees
from autopar.spec.meta import tolerant_meta
from autopar.spec.module_copy import copy_module
from autopar.spec.tp_plan import is_tp_linear
from autopar.spec.tp_shard import shard_block_for_tp


@dataclass(frozen=True, kw_only=True)
class PlannedUnit:
    """One block (or one unit of each kind of a chain) and its tp plan: what the degrees are run on.
    ``prefix``: put before its layer names in reasons ("" for a block list's block, block-relative
    as the plan's names are); ``container``: the dotted path of the list holding it."""

    prefix: str
    module: nn.Module
    styles: Mapping[str, str]
    local_attrs: tuple[str, ...]
    container: str


def planned_widths(units: tuple[PlannedUnit, ...]) -> tuple[tuple[str, int], ...]:
    """(layer name, the width tp splits) of every planned layer: colwise its outputs, rowwise its
    inputs."""
    out = []
    for unit in units:
        for name, style in unit.styles.items():
            try:
                layer = unit.module.get_submodule(name)
            except AttributeError:
                continue
            if not is_tp_linear(layer):
                continue
            # nn.Linear, or HF Conv1D (weight (in, out))
            in_f, out_f = ((layer.in_features, layer.out_features) if isinstance(layer, nn.Linear)
                           else tuple(layer.weight.shape))
            out.append((f"{unit.prefix}{name}", out_f if style == "colwise" else in_f))
    return tuple(out)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def refused_degrees(degrees: tuple[int, ...], unit: PlannedUnit, call: tuple[tuple, dict] | None,
                    what: str = "the block") -> tuple[tuple[int, str], ...]:
    """(degree, why) for each of ``degrees`` at which a meta copy of ``unit`` at one rank's width
    fails, run once each with ``call`` (the (args, kwargs) the model's forward gave it; None: the
    forward could not be recorded, and nothing is refused: the rules alone decide)."""
    if call is None or not unit.styles:
        return ()
    args, kwargs = call
    refused = []
    for tp in degrees:
        try:
            rank_unit = shard_block_for_tp(copy_module(unit.module), unit.styles, tp, unit.local_attrs,
                                           unit.container)
            with torch.no_grad(), tolerant_meta():
                rank_unit(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's block at a rank's width, on meta
            refused.append((tp, f"{what} does not run at tp = {tp} ({_first_line(exc)}); pick another tp"))
    return tuple(refused)


def tp_degrees_of(heads: int | None, kv_heads: int | None, units: tuple[PlannedUnit, ...],
                  first_call: Callable[[nn.Module], tuple[tuple, dict] | None] | None) -> TPDegrees:
    """The TPDegrees of a model: the rules from its heads and the planned widths of ``units`` (a
    block list's block 0, or one unit of each kind of a chain), and the degrees among those the
    rules allow at which a unit fails on meta (``first_call(module)``: how the model's forward
    called it; None: the rules alone). A degree is refused with the first failing unit's reason."""
    units = tuple(u for u in units if u.styles)
    rules = TPDegrees(num_heads=heads, num_kv_heads=kv_heads, widths=planned_widths(units))
    if first_call is None:
        return rules
    refused: dict[int, str] = {}
    for unit in units:
        what = "the block" if not unit.prefix else unit.prefix.rstrip(".")
        left = tuple(d for d in rules.candidates() if d not in refused)
        refused.update(refused_degrees(left, unit, first_call(unit.module), what))
    return dataclasses.replace(rules, refused=tuple(sorted(refused.items())))
