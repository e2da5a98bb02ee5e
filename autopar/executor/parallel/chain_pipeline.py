"""Pipeline chunks of a layer chain (spec/chain.py): a model without a repeated block list (a
ResNet's stages of different widths), or a block list kept in an ``nn.Sequential`` (a timm-style
ViT), cut at unit inputs without changing the model's code.

A chunk holding units [s, e) of L is a deep copy of the meta model in which

* units before s are ``_MetaStub``s returning a meta tensor of the unit's recorded output shape,
  and unit s gets a forward pre-hook that replaces its first argument by the activation received
  from the previous stage (the model's own forward runs before it, on meta, for free);
* unit e is an ``_Exit`` that leaves the forward with its input (what the next stage receives),
  and units after e are ``_Dropped`` (never reached);
* every module outside the chain, and every parameter owned by the root or an ancestor of a unit
  ("bare"), is real on the chunk whose code runs it (chain positions, spec/chain.py: position 0 on
  the first chunk, positions s < p <= e on this one), a meta stub (module) or a plain meta tensor
  attribute (parameter, so it is never materialised or trained) at positions p <= s of a later
  chunk, and dropped past e.

The received activation enters through a hook rather than a wrapper, so parameter names stay the
full model's. FSDP2's own pre-forward hook on unit s runs first (it is prepended) and sees the
meta stub; the unit's gradients are then reduced in FSDP2's end-of-backward callback.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from autopar.executor.parallel.pipeline_parallel import STAGE_ATTR, _Dropped, _replace, _StageExit
from autopar.executor.parallel.stand_in import StandIn
from autopar.modelfile import call_model
from autopar.spec import ModelSpec
from autopar.spec.meta import tolerant_meta

Shapes = dict[str, tuple[torch.Size, torch.dtype]]


class _MetaStub(StandIn):
    """Stands in for a unit (or module) before the chunk: a meta tensor of the recorded shape."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape, self.dtype = tuple(shape), dtype

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


class _Exit(StandIn):
    """The unit after the chunk: leaves the model's forward with its input (the next stage's)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise _StageExit(x)


class _Inject:
    """Holds the activation received from the previous stage while the chunk's forward runs."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


class ChainStage(nn.Module):
    """One pipeline chunk of a layer chain: the first takes the micro-batch, a later one the
    activation of the previous stage (``forward(x)``); the model's own forward runs on meta
    example inputs before the chunk's first unit (stubs), so its code is unchanged. The chunk sits
    under ``pipeline_parallel.STAGE_ATTR``, as a block-list StageModule's does."""

    def __init__(self, model: nn.Module, *, is_first: bool, is_last: bool, meta_inputs: Any,
                 inject: _Inject | None) -> None:
        super().__init__()
        setattr(self, STAGE_ATTR, model)
        self.is_first, self.is_last = is_first, is_last
        self._meta_inputs = meta_inputs  # a plain attribute: not a buffer, never materialised
        self._inject = inject
        self.call_kwargs: dict[str, Any] = {}

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        model = getattr(self, STAGE_ATTR)
        if self.is_first:
            inputs = args[0] if len(args) == 1 else args
        else:
            assert self._inject is not None
            self._inject.value = args[0]
            inputs = self._meta_inputs
        try:
            return call_model(model, inputs)
        except _StageExit as stop:
            return stop.value
        finally:
            if self._inject is not None:
                self._inject.value = None


def uses_chain_chunks(spec: ModelSpec) -> bool:
    """Whether the pipeline cuts this model at unit inputs (this module) rather than as a block list.
    A chain that is one nn.ModuleList's blocks (``Chain.block_list``: blocks that differ, DeepSeek's
    dense then MoE layers) is cut as a block list: every stage runs the model's forward for real,
    so what it hands the blocks beside their input (masks, rotary tables) exists on every stage."""
    return spec.chain is not None and spec.chain.block_list is None


def probe_chain_shapes(model: nn.Module, spec: ModelSpec, meta_inputs: Any) -> Shapes:
    """The output shape and dtype of every unit and every module outside the chain, at the chunk's
    micro-batch (one meta forward)."""
    assert spec.chain is not None
    return _probe(model, list(spec.chain.units) + list(spec.chain.modules), meta_inputs, inputs=False)


def probe_unit_inputs(model: nn.Module, spec: ModelSpec, meta_inputs: Any) -> Shapes:
    """The shape and dtype of every unit's first argument at the chunk's micro-batch (one meta
    forward): what a chunk starting at the unit receives, and what one ending before it hands on
    (``_Exit`` leaves with its input). A rehearsal fixes its stages' shapes with them."""
    assert spec.chain is not None
    return _probe(model, list(spec.chain.units), meta_inputs, inputs=True)


def _probe(model: nn.Module, names: list[str], meta_inputs: Any, *, inputs: bool) -> Shapes:
    """Shape and dtype of each named module's first argument (``inputs``) or tensor output, the
    first time it runs in one meta forward of ``model``."""
    out: Shapes = {}
    handles = []

    def seen(n: str, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            out.setdefault(n, (t.shape, t.dtype))

    for name in names:
        module = model.get_submodule(name)
        if inputs:
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: seen(n, a[0] if a else None)))
        else:
            handles.append(module.register_forward_hook(lambda m, a, o, n=name: seen(n, o)))
    try:
        with torch.no_grad(), tolerant_meta():
            call_model(model, meta_inputs)
    finally:
        for h in handles:
            h.remove()
    return out


def _runs_here(p: int, start: int, end: int) -> bool:
    return (p == 0 and start == 0) or start < p <= end


def build_chain_chunk(model: nn.Module, spec: ModelSpec, shapes: Shapes, unit_range: tuple[int, int], *,
                      is_first: bool, is_last: bool, meta_inputs: Any) -> ChainStage:
    """A ChainStage holding units ``[start, end)`` of a deep copy of the meta ``model`` (module docstring)."""
    chain = spec.chain
    assert chain is not None
    start, end = unit_range
    chunk = copy.deepcopy(model)
    inject = None
    stand_ins: dict[str, nn.Module] = {}
    for i, name in enumerate(chain.units):
        if i < start:
            shape, dtype = shapes[name]
            stand_ins[name] = _MetaStub(shape, dtype)
        elif i == start and not is_first:
            inject = _Inject()
            holder = inject

            def swap(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                return (holder.value,) + tuple(args[1:]), kwargs

            chunk.get_submodule(name).register_forward_pre_hook(swap, with_kwargs=True)
        elif i == end and not is_last:
            stand_ins[name] = _Exit()
        elif i > end:
            stand_ins[name] = _Dropped()
    for name, stand_in in stand_ins.items():  # answers what model code reads off the unit (stand_in.py)
        stand_in.stand_for(chunk.get_submodule(name), name)
    _place_stand_ins(chunk, stand_ins)
    for name, positions in chain.modules.items():
        p = positions[0] if positions else 0
        if _runs_here(p, start, end):
            continue
        original = chunk.get_submodule(name)
        if p <= start and name in shapes:
            shape, dtype = shapes[name]
            _replace(chunk, name, _MetaStub(shape, dtype).stand_for(original, name))
        else:
            _replace(chunk, name, _Dropped().stand_for(original, name))
    for name, positions in chain.bare.items():
        p = positions[0] if positions else 0
        if _runs_here(p, start, end):
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = chunk.get_submodule(owner_name) if owner_name else chunk
        param = owner._parameters.pop(leaf)
        # a plain attribute: the model's code still reads it (on meta), nothing materialises or trains it
        setattr(owner, leaf, torch.empty(param.shape, dtype=param.dtype, device="meta"))
    return ChainStage(chunk, is_first=is_first, is_last=is_last, meta_inputs=meta_inputs, inject=inject)


def _place_stand_ins(chunk: nn.Module, stand_ins: dict[str, nn.Module]) -> None:
    """Put each stand-in where its unit was. In an nn.Sequential (called in order, whatever the
    keys) a stand-in gets a non-digit key, so code that walks a block list's digit keys (TP, CP,
    recompute) sees only the chunk's real blocks, under their original indices; elsewhere (a
    ModuleList may be indexed) the key stays."""
    by_parent: dict[str, dict[str, nn.Module]] = {}
    for name, mod in stand_ins.items():
        parent, _, key = name.rpartition(".")
        by_parent.setdefault(parent, {})[key] = mod
    for parent_name, repl in by_parent.items():
        parent = chunk.get_submodule(parent_name) if parent_name else chunk
        if not isinstance(parent, nn.Sequential):
            for key, mod in repl.items():
                setattr(parent, key, mod)
            continue
        kind = {_MetaStub: "before", _Exit: "exit", _Dropped: "after"}
        items = [(f"{kind[type(repl[k])]}_{k}" if k in repl else k, repl.get(k, m)) for k, m in parent.named_children()]
        new = nn.Sequential(OrderedDict(items))
        new.__dict__.update({k: v for k, v in parent.__dict__.items() if k not in new.__dict__})
        new.train(parent.training)
        if parent_name:
            _replace(chunk, parent_name, new)
        else:
            raise ValueError("the model itself is the chain's container; wrap it in a module to pipeline it")


def unit_modules(part: nn.Module, spec: ModelSpec, prefix: str = "") -> list[nn.Module]:
    """The chain's units present (not stubbed) in ``part``: what FSDP2 wraps and recompute
    checkpoints one by one. ``prefix``: where the model sits in ``part`` ("model." in a stage)."""
    out = []
    stand_ins = (_MetaStub, _Exit, _Dropped)
    for name in spec.unit_paths:
        try:
            mod = part.get_submodule(prefix + name)
        except AttributeError:
            continue
        if not isinstance(mod, stand_ins):
            out.append(mod)
    return out
