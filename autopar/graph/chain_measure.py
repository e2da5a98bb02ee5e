"""Measure a chain model (no repeated block; spec/chain.py) on meta into a ModelGraph.

The model is traced with each chain container cut to the units that must run (the first unit of
each kind, and units that change their input's shape; ``kept_units``), with regions switched at
every unit: ``pre`` (the stem), ``unit.i`` (unit i and the code after it up to the next unit),
``post`` (after the last unit) and ``loss``; backward regions switch by gradient hooks on each
unit's input and output, as graph/build.py does for a block. Units of one kind (same class,
parameter shapes and input shape, and no module running between it and the next unit) share the
fitted region of the first of them, ``unit.k``; each unit keeps its own parameter count. The graph
is fitted at micro-batch 1 and 2 and, for sequence models, half the sequence (graph/scaling.py).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from autopar.errors import ModelFileError
from autopar.graph.build import (
    ParamRegions,
    TracedRun,
    batch_input_bytes,
    first_tensor,
    forward_backward,
    peak_records,
    slice_sequence,
)
from autopar.graph.chain_tp import chain_tp_comm_hooks, shard_chain_for_tp, sharded_params
from autopar.graph.fused_scan import fit_with_scan
from autopar.graph.model_graph import ChainUnit, ModelGraph, MoEFacts, RegionParams
from autopar.graph.scaling import RegionFit, fit_output
from autopar.graph.trace import Trace, run_and_trace
from autopar.modelfile import ModelFile
from autopar.spec import ModelSpec
from autopar.spec.tp_plan import TPPlan
from autopar.usercode import model_failed

_NO_TP = TPPlan(styles={}, source="none")


def measured_kinds(spec: ModelSpec) -> tuple[int, ...]:
    """``spec.chain.kinds``, except that a unit followed by a module or a parameter read before the
    next unit (the glue its region also holds) is a kind of its own."""
    chain = spec.chain
    assert chain is not None
    glue = {p for pos in list(chain.modules.values()) + list(chain.bare.values()) for p in pos
            if 0 < p < chain.num_units}
    out: list[int] = []
    for i, k in enumerate(chain.kinds):
        if i + 1 in glue:
            out.append(i)
        else:  # the first unit of its kind without glue after it (at the latest: itself)
            out.append(next(j for j in range(i + 1) if chain.kinds[j] == k and j + 1 not in glue))
    return tuple(out)


def kept_units(spec: ModelSpec, kinds: tuple[int, ...]) -> tuple[int, ...]:
    """Units the measurement runs: the first of each kind, and every unit that changes the shape of
    its input (removing it would change what the next unit receives). A removed unit has the class,
    shapes and input shape of its kind's first unit and keeps its input's shape, so the units after
    it receive what they receive in the full model."""
    chain = spec.chain
    assert chain is not None
    outs = chain.output_shapes or chain.input_shapes
    return tuple(i for i, k in enumerate(kinds) if k == i or outs[i] != chain.input_shapes[i])


class PassThrough(nn.Module):
    """A unit the measurement does not run, left in its place: it returns its hidden-state input."""

    passes_through = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


def cut_chain_model(model: nn.Module, units: tuple[str, ...], keep: tuple[int, ...], *,
                    in_place: bool = False) -> nn.Module:
    """A shallow copy of ``model`` whose chain containers hold only the units ``keep`` (shared, not
    copied; a Sequential keeps its keys, a ModuleList is renumbered as it is iterated). ``in_place``:
    every other unit stays in its place as a ``PassThrough`` instead, for a forward that hands each
    unit its position in the list (Zamba2 looks its hybrid layers up by it)."""
    clone = copy.copy(model)
    clone._modules = dict(model._modules)  # type: ignore[attr-defined]
    copied = {"": clone}

    def writable(path: str) -> nn.Module:
        if path not in copied:
            parent_path, _, leaf = path.rpartition(".")
            parent = writable(parent_path)
            mod = copy.copy(parent._modules[leaf])
            mod._modules = dict(mod._modules)
            parent._modules[leaf] = mod
            copied[path] = mod
        return copied[path]

    kept = {units[i] for i in keep}
    containers = dict.fromkeys(u.rpartition(".")[0] for u in units)
    for c in containers:
        old = model.get_submodule(c)
        children = [(k, m if in_place is False or f"{c}.{k}" in kept or f"{c}.{k}" not in units else PassThrough())
                    for k, m in old.named_children() if in_place or f"{c}.{k}" in kept or f"{c}.{k}" not in units]
        if isinstance(old, (nn.Sequential, nn.ModuleDict)):  # keyed containers keep their keys
            new = type(old)(OrderedDict(children))
        else:
            new = nn.ModuleList(m for _, m in children)
        parent_path, _, leaf = c.rpartition(".")
        writable(parent_path)._modules[leaf] = new
    return clone


def trace_chain_model(model: nn.Module, inputs: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                      unit_mods: list[nn.Module], tp_styles: Sequence[Mapping[str, str]] = ()
                      ) -> tuple[TracedRun, list[float]]:
    """One forward+backward of ``model`` on meta attributed to pre / unit.i / post / loss (i: the
    position in ``unit_mods``, the units the forward runs, in order), its memory timeline
    (``Trace.peaks``, graph/live.py, from a second, unrecorded run: the loss's fp32 logits and their
    gradients, each unit's gradients of activations), and the bytes of the tensor each unit
    received. ``tp_styles[i]``: unit i's TP plan, whose collectives are recorded in its region
    (graph/chain_tp.py); empty: no TP."""
    regions = ParamRegions(model)
    handles = regions.handles
    in_bytes = [0.0] * len(unit_mods)
    in_roots: list[int | None] = [None] * len(unit_mods)
    out_roots: list[int | None] = [None] * len(unit_mods)
    io: dict[str, float] = {"out": 0.0}
    for p in model.parameters():  # every traced backward starts without gradients, as a step's first
        p.grad = None  # does: a gradient left by the previous shape's run turns its copies into adds

    def run(set_region_raw: Callable[[str], None]) -> None:
        set_region = regions.setter(set_region_raw)
        if tp_styles:
            handles.extend(chain_tp_comm_hooks(unit_mods, tp_styles, trace))
        handles.extend(_unit_hooks(unit_mods, set_region, in_bytes, (in_roots, out_roots)))
        forward_backward(model, inputs, loss_fn, set_region, io)

    trace = Trace()
    try:
        run_and_trace(run, model.parameters(), trace)
    finally:
        for h in handles:
            h.remove()
    hooks: list = []

    def step(set_region: Callable[[str], None]) -> None:
        hooks.extend(_unit_hooks(unit_mods, set_region, [0.0] * len(unit_mods)))
        forward_backward(model, inputs, loss_fn, set_region)

    trace.peaks = peak_records(step, list(model.parameters()), hooks)
    # whether each unit saves the very tensors it receives and returns (a pipeline cut's receive
    # buffer, and the output the stage before keeps: cost/chain.py)
    saved_roots = {(r.region, r.root) for r in trace.saved}
    saves_in = tuple((f"unit.{i}", root) in saved_roots for i, root in enumerate(in_roots))
    saves_out = tuple((f"unit.{i}", root) in saved_roots for i, root in enumerate(out_roots))
    return TracedRun(trace=trace, param_regions=regions.by_param, block_input_bytes=in_bytes[0],
                     output_bytes=io["out"], unit_saves_input=saves_in, unit_saves_output=saves_out), in_bytes


def _unit_hooks(unit_mods: list[nn.Module], set_region: Callable[[str], None], in_bytes: list[float],
                roots: tuple[list[int | None], list[int | None]] | None = None) -> list:
    """Hooks that switch the region at each unit's entry (and, in backward, when its input's
    gradient is done: what ran before it is next) and after the last unit (post); ``in_bytes[i]``
    becomes the bytes of unit i's input, ``roots``' lists [i] the ids of the root tensors of unit
    i's input's and output's storages."""
    handles = []
    last = len(unit_mods) - 1
    for i, mod in enumerate(unit_mods):
        def pre(mod: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            set_region(f"unit.{i}")
            x = first_tensor((args, kwargs))
            if x is not None:
                in_bytes[i] = float(x.numel() * x.element_size())
                if roots is not None:
                    roots[0][i] = id(x._base if x._base is not None else x)
                if x.requires_grad:  # its gradient done: what ran before unit i is next
                    before = "pre" if i == 0 else f"unit.{i - 1}"
                    x.register_hook(lambda g, r=before: set_region(f"bwd:{r}"))

        def post(mod: nn.Module, args: tuple, out: Any, i: int = i) -> None:
            if i == last:
                set_region("post")
            y = first_tensor(out)
            if y is not None and roots is not None:
                roots[1][i] = id(y._base if y._base is not None else y)
            if y is not None and y.requires_grad:
                y.register_hook(lambda g, i=i: set_region(f"bwd:unit.{i}"))

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        handles.append(mod.register_forward_hook(post))
    return handles


def build_chain_graph(mf: ModelFile, model: nn.Module, spec: ModelSpec, seq_len: int | None, dtype: str,
                      inputs: Callable[[int], Any], start: float) -> ModelGraph:
    """The ModelGraph of a chain model (see the module docstring). ``model``: built on meta in the
    plan's dtype; ``inputs(b)``: example inputs of b samples cast to that dtype."""
    chain = spec.chain
    assert chain is not None
    base_seq = seq_len or mf.seq_len
    is_seq = base_seq is not None and base_seq >= 2 and base_seq % 2 == 0

    def shaped(b: int) -> Any:
        inp = inputs(b)
        if base_seq is not None and mf.seq_len is not None and base_seq != mf.seq_len:
            if base_seq > mf.seq_len:
                raise ModelFileError(f"{mf.path}: sequence length {base_seq} exceeds the model file's SEQ_LEN {mf.seq_len}")
            inp = slice_sequence(inp, mf.seq_len, base_seq)
        return inp

    kinds = measured_kinds(spec)
    keep = kept_units(spec, kinds)
    small = cut_chain_model(model, chain.units, keep)
    mods = [model.get_submodule(chain.units[i]) for i in keep]
    support = dict(spec.support)
    # a list of differing blocks with a TP plan per unit kind (spec/chain_tp.py): each run unit's own
    plans = [spec.unit_tp(i) for i in keep] if spec.kind_tp and support["tp"] is None else []
    styles = [p.styles for p in plans]

    def run(inp: Any, m: nn.Module | None = None, units: list[nn.Module] | None = None, loss_fn: Any = mf.loss_fn
            ) -> tuple[TracedRun, list[float]]:
        try:
            return trace_chain_model(small if m is None else m, inp, loss_fn, mods if units is None else units, styles)
        except ModelFileError as exc:
            raise ModelFileError(str(exc) if str(exc).startswith(str(mf.path)) else f"{mf.path}: {exc}") from None
        except Exception as exc:  # the user's forward or loss on meta
            raise model_failed(mf.path, "on the meta device", exc) from None

    inputs1 = shaped(1)
    try:
        base, kept_in = run(inputs1)
    except ModelFileError:
        if len(keep) == len(chain.units):
            raise
        # the cut model failed the model's code: a forward that hands each unit its loop position
        # (Zamba2) runs with the unrun units left in place as pass-throughs, where units return a
        # tensor; one that counts the units' outputs (Funnel reads the hidden state after
        # block_sizes[0] layers) runs every unit
        base = None
        if chain.block_list is not None and (chain.probe is None or chain.probe.block_output == "Tensor"):
            small = cut_chain_model(model, chain.units, keep, in_place=True)
            try:
                base, kept_in = run(inputs1)
            except ModelFileError:
                base = None
        if base is None:
            keep = tuple(range(len(chain.units)))
            small, mods = model, [model.get_submodule(u) for u in chain.units]
            plans = [spec.unit_tp(i) for i in keep] if plans else []
            styles = [p.styles for p in plans]
            base, kept_in = run(inputs1)
    b2, _ = run(shaped(2))
    s_half = run(slice_sequence(inputs1, base_seq, base_seq // 2))[0] if is_seq else None
    t2, loss_t2 = (_trace_tp2(run, small, chain.block_list, plans, inputs1, support) if plans else (None, True))
    # traced region unit.j is kept unit keep[j]; rename to the chain index of the unit
    for tr in filter(None, (base, b2, s_half, t2)):
        _rename_regions(tr.trace, {f"unit.{j}": f"unit.{i}" for j, i in enumerate(keep)})
    regions: dict[str, RegionFit] = {}
    names = ["pre", "post", "loss"] + [f"unit.{k}" for k in sorted(set(kinds))]
    for region in names:
        t2_region = t2.trace if t2 is not None and (loss_t2 or region != "loss") else None
        try:
            regions[region] = fit_with_scan(region, base.trace, b2.trace, s_half and s_half.trace, t2_region,
                                            base_seq if s_half else None)
        except ValueError:
            regions[region] = fit_with_scan(region, base.trace, b2.trace, None, None)
    at = dict(zip(keep, kept_in))
    saves_at = dict(zip(keep, zip(base.unit_saves_input, base.unit_saves_output)))
    param_regions = {pid: {_unit_region(r, keep) for r in rs} for pid, rs in base.param_regions.items()}
    unit_params, pre, post, tied = _params(model, chain.units, param_regions)
    moe_units = set(spec.moe_units)
    units = tuple(ChainUnit(name=u, region=f"unit.{kinds[i]}", params=unit_params[i], input_bytes=at.get(i, at[kinds[i]]),
                            experts=u in moe_units, saves_input=saves[0], saves_output=saves[1])
                  for i, u in enumerate(chain.units)
                  for saves in (saves_at.get(i, saves_at.get(kinds[i], (False, False))),))
    regions["block"] = regions[units[0].region]
    edges = _edge_sharded(small, chain.block_list, base) if t2 is not None else {"pre": 0, "post": 0}
    params = {"pre": RegionParams(count=pre, tp_sharded=edges["pre"]),
              "post": RegionParams(count=post, tp_sharded=edges["post"]),
              "loss": RegionParams(count=0, tp_sharded=0), "block": RegionParams(count=units[0].params, tp_sharded=0)}
    if t2 is not None:  # per unit kind: its parameters and those its plan divides (cost/chain.py)
        for k in sorted(set(kinds)):
            i = next(i for i, kk in enumerate(kinds) if kk == k)
            unit = model.get_submodule(chain.units[i])
            params[f"unit.{k}"] = RegionParams(count=units[i].params, tp_sharded=sharded_params(unit, spec.unit_tp(i)))
    if not is_seq and support["cp"] is None:
        support["cp"] = f"sequence length {base_seq} cannot be split"
    return ModelGraph(
        name=mf.name, sha256=mf.sha256, num_blocks=len(units), seq_len=base_seq if is_seq else 1,
        is_sequence_model=is_seq, dtype=dtype, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
        tp_reason=support["tp"], cp_reason=support["cp"], pp_reason=support["pp"], support=support,
        tp_source=_tp_source(spec), tp_styles={}, moe_tp_styles=_moe_tp_styles(spec, support),
        regions=regions, params=params, tied_params=tied,
        block_input_bytes=units[0].input_bytes,
        batch_input_bytes=batch_input_bytes(mf) * (base_seq / mf.seq_len if is_seq and mf.seq_len else 1.0),
        build_seconds=time.perf_counter() - start, chain=units, moe=MoEFacts.of(spec.moe),
        tp_degrees=spec.tp_degrees,
        output=fit_output(base, b2, s_half, t2),
    )


def _trace_tp2(run: Callable[..., tuple[TracedRun, list[float]]], small: nn.Module, container: str | None,
               plans: list[Any], inputs1: Any, support: dict[str, str | None]) -> tuple[TracedRun | None, bool]:
    """(the trace of one tp = 2 rank's copy of the cut chain, whether its loss region is usable), as
    graph/measure.py traces a block's: a loss that holds the vocabulary as a constant is traced on
    the model's localised vocabulary attributes, else with the model's default loss (the loss region
    then fitted without tp). A copy that does not trace turns tp (and sp) off in ``support``."""
    assert container is not None  # plans per unit kind exist only for one module list of units
    sharded = shard_chain_for_tp(small, container, plans, 2)
    units = _run_units(sharded, container)
    try:
        return run(inputs1, sharded, units)[0], True
    except ModelFileError as exc:
        local = shard_chain_for_tp(small, container, plans, 2, vocab_constants=True)
        try:
            return run(inputs1, local, _run_units(local, container))[0], True
        except ModelFileError:
            try:
                return run(inputs1, sharded, units, None)[0], False
            except ModelFileError:
                support.update(tp=f"the chain's units do not run on tp-sharded Linear layers ({exc})",
                               sp=support["sp"] or "needs tp")
                return None, True


def _run_units(model: nn.Module, container: str) -> list[nn.Module]:
    """The units of ``container`` the measurement runs (not the PassThroughs left in place)."""
    return [u for u in model.get_submodule(container) if not getattr(u, "passes_through", False)]


def _edge_sharded(small: nn.Module, container: str | None, base: TracedRun) -> dict[str, int]:
    """Parameters of the stem (pre) and head (post) the tp rank's copy holds at half width
    (``base``: the trace of ``small`` itself, whose parameter regions say which edge holds each)."""
    out = {"pre": 0, "post": 0}
    sharded = shard_chain_for_tp(small, container, [_NO_TP] * len(_run_units(small, container)), 2)
    inside = container + "."
    for (name, p), (_, q) in zip(small.named_parameters(), sharded.named_parameters()):
        if p.numel() != q.numel() and not name.startswith(inside):
            regions = base.param_regions.get(id(p), {"pre"})
            out["pre" if "pre" in regions else "post"] += p.numel()
    return out


def _moe_tp_styles(spec: ModelSpec, support: Mapping[str, str | None]) -> dict[str, str]:
    """The TP plan of the first unit holding the experts, where the chain has plans per unit kind
    and TP runs: the units holding them hold one same mixture (spec.chain_experts), so whether
    that plan shards the experts is what the cost model prices for all of them."""
    if not (spec.kind_tp and spec.moe_units and support.get("tp") is None):
        return {}
    return dict(spec.unit_tp(spec.chain.units.index(spec.moe_units[0])).styles)


def _tp_source(spec: ModelSpec) -> str:
    if spec.kind_tp:
        return "per unit kind: " + "; ".join(k.describe() for k in spec.kind_tp)
    return spec.tp.describe()


def _unit_region(region: str, keep: tuple[int, ...]) -> str:
    return f"unit.{keep[int(region.split('.')[1])]}" if region.startswith("unit.") else region


def _rename_regions(trace: Trace, names: dict[str, str]) -> None:
    trace.ops[:] = [dataclasses.replace(o, region=names.get(o.region, o.region)) for o in trace.ops]
    trace.saved[:] = [dataclasses.replace(r, region=names.get(r.region, r.region)) for r in trace.saved]
    trace.comm[:] = [(names.get(c[0], c[0]), *c[1:]) for c in trace.comm]
    trace.peaks[:] = [dataclasses.replace(p, region=names.get(p.region, p.region)) for p in trace.peaks]


def _params(model: nn.Module, units: tuple[str, ...], param_regions: dict[int, set[str]]
            ) -> tuple[list[int], int, int, int]:
    """Parameters per unit, of the stem (pre), of the head (post), and tied between them. A
    parameter outside the units used only by the glue after unit i counts for unit i."""
    seen: set[int] = set()
    per_unit = []
    for path in units:
        n = 0
        for p in model.get_submodule(path).parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        per_unit.append(n)
    pre = post = tied = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        regions = param_regions.get(id(p), {"pre"})
        if "pre" in regions:
            pre += p.numel()
            tied += p.numel() if "post" in regions else 0
        elif "post" in regions:
            post += p.numel()
        else:
            first = min(int(r.split(".")[1]) for r in regions if r.startswith("unit."))
            per_unit[first] += p.numel()
    return per_unit, pre, post, tied
