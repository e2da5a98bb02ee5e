"""The meta-device probe of a model for pipeline parallelism (executor/pipeline_parallel.py).

One forward of the full model on meta records what a pipeline chunk must reproduce: which modules
beside the block list run before the first block (the prologue) and after the last (the epilogue),
the structure (``Template``) of what each prologue module, a block and the whole model return, the
name of a block's first forward parameter, and in which phase ("prologue", "blocks", "epilogue")
the model's own code reads each bare parameter (one registered on the root or an ancestor of the
block list). Reads are seen through a ``TorchFunctionMode``; value reads of meta tensors are
answered by ``spec.meta.tolerant_meta``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from autopar.executor.introspect import ModelSpec
from autopar.modelfile import call_model


@dataclass(frozen=True)
class Template:
    """The structure of a value: its pytree spec, and per leaf either a non-tensor value or the
    (shape, dtype) of a tensor."""

    spec: TreeSpec
    leaves: tuple[Any, ...]
    is_tensor: tuple[bool, ...]

    @staticmethod
    def of(value: Any) -> "Template":
        leaves, spec = tree_flatten(value)
        is_t = tuple(isinstance(v, torch.Tensor) for v in leaves)
        return Template(spec, tuple((tuple(v.shape), v.dtype) if t else v for v, t in zip(leaves, is_t)), is_t)

    def rebuild(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> Any:
        """The value with its tensor leaves taken, in order, from ``tensors``."""
        it = iter(tensors)
        return tree_unflatten([next(it) if t else v for v, t in zip(self.leaves, self.is_tensor)], self.spec)

    def zeros(self, device: torch.device) -> Any:
        return self.rebuild([torch.zeros(v[0], dtype=v[1], device=device) for v, t in zip(self.leaves, self.is_tensor) if t])


def tensors_of(value: Any) -> tuple[torch.Tensor, ...]:
    return tuple(v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor))


@dataclass(frozen=True, kw_only=True)
class Probe:
    """What one meta forward showed (module docstring): prologue module name -> (output structure,
    holds parameters); epilogue names; a block's output structure and first forward parameter;
    bare parameter name -> phases that read it ("prologue", "blocks", "epilogue")."""

    prologue: dict[str, tuple[Template, bool]]
    epilogue: tuple[str, ...]
    block_out: Template
    block_first_param: str | None
    bare: dict[str, frozenset[str]]
    output: Template  # what the whole model returns


def _siblings(model: nn.Module, blocks_path: str) -> dict[str, nn.Module]:
    path = blocks_path.split(".")
    out: dict[str, nn.Module] = {}
    for depth in range(len(path)):
        prefix = ".".join(path[:depth])
        parent = model.get_submodule(prefix) if prefix else model
        for name, child in parent.named_children():
            if name != path[depth]:
                out[f"{prefix}.{name}" if prefix else name] = child
    return out


def _bare_parameters(model: nn.Module, blocks_path: str) -> dict[str, nn.Parameter]:
    """Parameters registered directly on the root or an ancestor of the block list."""
    path = blocks_path.split(".")
    out = {}
    for depth in range(len(path)):
        prefix = ".".join(path[:depth])
        owner = model.get_submodule(prefix) if prefix else model
        for name, p in owner.named_parameters(recurse=False):
            out[f"{prefix}.{name}" if prefix else name] = p
    return out


class _ReadRecorder(TorchFunctionMode):
    """Records in which phase any torch function reads one of the watched tensors."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched, self.phase = watched, "prologue"
        self.reads: dict[str, set[str]] = {n: set() for n in watched.values()}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        for v in tree_flatten((args, kwargs or {}))[0]:
            name = self.watched.get(id(v)) if isinstance(v, torch.Tensor) else None
            if name is not None:
                self.reads[name].add(self.phase)
        return func(*args, **(kwargs or {}))


def _first_param(block: nn.Module) -> str | None:
    try:
        params = list(inspect.signature(block.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return named[0].name if named else None


def probe_structure(model: nn.Module, spec: ModelSpec, meta_inputs: Any) -> Probe:
    """Run ``model`` (on meta) once and classify what runs around the block list."""
    from autopar.spec.meta import tolerant_meta

    events: list[tuple[str, str, Any]] = []
    handles = []
    for name, mod in _siblings(model, spec.blocks_path).items():
        handles.append(mod.register_forward_hook(lambda m, a, o, n=name: events.append(("mod", n, o))))
    blocks = model.get_submodule(spec.blocks_path)
    bare = _bare_parameters(model, spec.blocks_path)
    recorder = _ReadRecorder({id(p): n for n, p in bare.items()})
    block_out: list[Any] = []

    def on_first(m: nn.Module, a: tuple) -> None:
        events.append(("first", "", None))
        recorder.phase = "blocks"

    def on_last(m: nn.Module, a: tuple, o: Any) -> None:
        events.append(("last", "", None))
        block_out.append(o)
        recorder.phase = "epilogue"

    handles.append(blocks[0].register_forward_pre_hook(on_first))
    handles.append(blocks[len(blocks) - 1].register_forward_hook(on_last))
    try:
        with torch.no_grad(), tolerant_meta(), recorder:
            result = call_model(model, meta_inputs)
    finally:
        for h in handles:
            h.remove()
    kinds = [e[0] for e in events]
    first, last = kinds.index("first"), len(kinds) - 1 - kinds[::-1].index("last")
    prologue: dict[str, tuple[Template, bool]] = {}
    epilogue: list[str] = []
    for i, (kind, name, out) in enumerate(events):
        if kind != "mod":
            continue
        if i < first:
            holds = any(True for _ in model.get_submodule(name).parameters())
            prologue.setdefault(name, (Template.of(out), holds))
        elif i > last and name not in epilogue:
            epilogue.append(name)
    return Probe(prologue=prologue, epilogue=tuple(epilogue), block_out=Template.of(block_out[0]),
                 block_first_param=_first_param(blocks[0]),
                 bare={n: frozenset(r) for n, r in recorder.reads.items()}, output=Template.of(result))


def bare_holders(phases: frozenset[str], chunk: int, num_chunks: int) -> bool:
    """Whether chunk ``chunk`` of ``num_chunks`` runs a phase that reads a bare parameter (one read
    nowhere stays on the first chunk, so that it exists once)."""
    return ("blocks" in phases or (chunk == 0 and ("prologue" in phases or not phases))
            or (chunk == num_chunks - 1 and "epilogue" in phases))
