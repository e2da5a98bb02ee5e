"""Which tensor-parallel degrees run on a model (autopar.layout.TPDegrees), found on meta.

What differs from one degree to the next is one rank's share of the block: its heads, its slice of
each planned layer, a fused projection's parts. The shape rules (heads and widths divisible by tp)
are read from the spec; then block 0 is run on meta at one rank's width (spec/tp_shard.py, what the
planner's own tp trace builds) for every degree those rules allow, once per degree, with the
arguments the model's forward handed it. A degree whose block fails is refused with the error's
first line. The planner's search, ``autopar estimate`` and the executor's preflight all read the
result (``ModelSpec.tp_degrees``, copied into the graph), so none offers a degree another refuses.
"""

from __future__ import annotations

import copy
from typing import Callable, Mapping

import torch
from torch import nn

from autopar.layout import TPDegrees
from autopar.spec.meta import tolerant_meta
from autopar.spec.tp_plan import is_tp_linear
from autopar.spec.tp_shard import shard_block_for_tp


def planned_widths(units: Mapping[str, tuple[nn.Module, Mapping[str, str]]]) -> tuple[tuple[str, int], ...]:
    """(layer name, the width tp splits) of every planned layer: colwise its outputs, rowwise its
    inputs. ``units``: a name prefix -> (a block or unit of each kind, its tp styles)."""
    out = []
    for prefix, (unit, styles) in units.items():
        for name, style in styles.items():
            try:
                layer = unit.get_submodule(name)
            except AttributeError:
                continue
            if not is_tp_linear(layer):
                continue
            # nn.Linear, or HF Conv1D (weight (in, out))
            in_f, out_f = ((layer.in_features, layer.out_features) if isinstance(layer, nn.Linear)
                           else tuple(layer.weight.shape))
            out.append((f"{prefix}{name}", out_f if style == "colwise" else in_f))
    return tuple(out)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def block_degrees(rules: TPDegrees, block: nn.Module, styles: Mapping[str, str], local_attrs: tuple[str, ...],
                  blocks_path: str, call: tuple[tuple, dict] | None) -> TPDegrees:
    """``rules`` with ``refused`` filled: each degree of ``rules.candidates()`` run once on a meta copy
    of ``block`` at one rank's width, called with ``call`` (the (args, kwargs) the model's forward
    gave it; None: the forward could not be recorded, and only the rules decide)."""
    if call is None or not styles:
        return rules
    args, kwargs = call
    refused = []
    for tp in rules.candidates():
        try:
            rank_block = shard_block_for_tp(copy.deepcopy(block), styles, tp, local_attrs, blocks_path)
            with torch.no_grad(), tolerant_meta():
                rank_block(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's block at a rank's width, on meta
            refused.append((tp, f"the block does not run at tp = {tp} ({_first_line(exc)}); pick another tp"))
    return TPDegrees(num_heads=rules.num_heads, num_kv_heads=rules.num_kv_heads, widths=rules.widths,
                     refused=tuple(refused))


def tp_degrees_of(heads: int | None, kv_heads: int | None, block: nn.Module | None, styles: Mapping[str, str],
                  local_attrs: tuple[str, ...], blocks_path: str,
                  first_call: Callable[[nn.Module], tuple[tuple, dict] | None] | None,
                  kinds: Mapping[str, tuple[nn.Module, Mapping[str, str]]] | None = None) -> TPDegrees:
    """The TPDegrees of a model: the rules from its heads and the planned widths of ``block`` (or,
    for a chain with plans per unit kind, of each of ``kinds``), and for a block list the degrees its
    block 0 refuses on meta (``first_call(block)``: how the forward called it). A chain's units are
    held to the rules only."""
    units: dict[str, tuple[nn.Module, Mapping[str, str]]] = dict(kinds or {})
    if block is not None and styles:
        units[""] = (block, styles)
    rules = TPDegrees(num_heads=heads, num_kv_heads=kv_heads, widths=planned_widths(units))
    if block is None or not styles or first_call is None:
        return rules
    return block_degrees(rules, block, styles, local_attrs, blocks_path, first_call(block))
