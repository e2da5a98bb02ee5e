"""The meta-device probe of a model for pipeline parallelism (executor/parallel/pipeline_parallel.py cuts the
model with it; graph/carried.py prices the values it finds carried).

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

from autopar.modelfile import call_model
from autopar.spec.blocks import siblings as module_siblings
from autopar.spec.model_spec import ModelSpec


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
        shapes = [v for v, t in zip(self.leaves, self.is_tensor) if t]
        return self.rebuild([torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in shapes])


def tensors_of(value: Any) -> tuple[torch.Tensor, ...]:
    return tuple(v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor))


@dataclass(frozen=True, kw_only=True)
class Probe:
    """What one meta forward showed (module docstring): prologue module name -> (output structure,
    holds parameters); epilogue names; a block's output structure and first forward parameter;
    bare parameter name -> phases that read it ("prologue", "blocks", "epilogue"); the shared
    prologue modules (see ``probe_structure``)."""

    prologue: dict[str, tuple[Template, bool]]
    epilogue: tuple[str, ...]
    block_out: Template
    block_first_param: str | None
    bare: dict[str, frozenset[str]]
    shared: tuple[str, ...]  # prologue modules kept real on every stage (probe_structure)
    output: Template  # what the whole model returns
    carried: tuple[str, ...] = ()  # prologue modules whose output the stages after the first receive


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


class _Recorder(TorchFunctionMode):
    """Records in which phase any torch function reads one of the watched parameters, and which
    sources (watched parameters, outputs of ``mark``ed modules) a value derives from (taint)."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched, self.phase = watched, "prologue"
        self.reads: dict[str, set[str]] = {n: set() for n in watched.values()}
        self.late: set[str] = set()  # marked sources a torch function of the epilogue reads
        self.taint: dict[int, frozenset[str]] = {}
        self._keep: list[torch.Tensor] = []  # tainted tensors stay alive: ids are not reused

    def mark(self, value: Any, origins: frozenset[str]) -> None:
        for v in tree_flatten(value)[0]:
            if isinstance(v, torch.Tensor):
                self.taint[id(v)] = self.taint.get(id(v), frozenset()) | origins
                self._keep.append(v)

    def origins(self, value: Any) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for v in tree_flatten(value)[0]:
            if isinstance(v, torch.Tensor):
                out |= self.taint.get(id(v), frozenset())
                name = self.watched.get(id(v))
                if name is not None:
                    out |= {name}
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        for v in tree_flatten((args, kwargs))[0]:
            name = self.watched.get(id(v)) if isinstance(v, torch.Tensor) else None
            if name is not None:
                self.reads[name].add(self.phase)
        out = func(*args, **kwargs)
        if self.phase == "prologue":
            origins = self.origins((args, kwargs))
            if origins:
                self.mark(out, origins)
        elif self.phase == "epilogue":
            self.late |= self.origins((args, kwargs))
        return out


def _first_param(block: nn.Module) -> str | None:
    try:
        params = list(inspect.signature(block.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return named[0].name if named else None


def probe_structure(model: nn.Module, spec: ModelSpec, meta_inputs: Any) -> Probe:
    """Run ``model`` (on meta) once and classify what runs around the block list.

    Bare parameters (``Probe.bare``) are those registered on the root or an ancestor of the block
    list, and those of sibling modules that never run as modules (read directly: ``x @
    self.wte.weight.T``). A parameter-holding prologue module that also runs in the epilogue, or
    whose parameters the epilogue reads directly (a head computing ``h @ self.embeddings.weight.T``
    from the input embedding's table), is ``shared``: real on every stage, its gradients summed
    over the stages. One whose output reaches
    a block other than through its hidden state (an encoder's output that every decoder block
    attends to, a learned bias passed as a keyword argument), or that the epilogue reads (CLIP's
    first tower, pooled into the contrastive loss after the other tower's blocks), is ``carried``:
    the first stage computes it once and every stage hands it on beside the hidden state, so later
    stages see the real value (not a stub's zeros) without running the module again, and its
    gradient flows back to the first stage. A bare parameter that reaches a block other than through
    the hidden state counts as read between the blocks.
    """
    from autopar.spec.meta import tolerant_meta

    events: list[tuple[str, str, Any]] = []
    handles = []
    siblings = module_siblings(model, spec.blocks_path)
    blocks = model.get_submodule(spec.blocks_path)
    first_param = _first_param(blocks[0])
    watched = dict(_bare_parameters(model, spec.blocks_path))
    for mname, mod in siblings.items():
        for pname, p in mod.named_parameters():
            watched.setdefault(f"{mname}.{pname}", p)
    recorder = _Recorder({id(p): n for n, p in watched.items()})
    holders = {n for n, m in siblings.items() if any(True for _ in m.parameters())}

    def on_module(m: nn.Module, a: tuple, o: Any, n: str) -> None:
        events.append(("mod", n, o))
        if recorder.phase == "prologue" and n in holders:
            recorder.mark(o, frozenset({n}))

    for name, mod in siblings.items():
        handles.append(mod.register_forward_hook(lambda m, a, o, n=name: on_module(m, a, o, n)))
    block_out: list[Any] = []
    side: set[str] = set()

    def on_first(m: nn.Module, a: tuple, kw: dict) -> None:
        events.append(("first", "", None))
        extra = (a[1:], {k: v for k, v in kw.items() if k != first_param}) if a else \
            (a, {k: v for k, v in kw.items() if k != first_param})
        side.update(recorder.origins(extra))
        recorder.phase = "blocks"

    def on_last(m: nn.Module, a: tuple, o: Any) -> None:
        events.append(("last", "", None))
        block_out.append(o)
        recorder.phase = "epilogue"

    handles.append(blocks[0].register_forward_pre_hook(on_first, with_kwargs=True))
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
            prologue.setdefault(name, (Template.of(out), name in holders))
        elif i > last and name not in epilogue:
            epilogue.append(name)
    ran = {n for k, n, _ in events if k == "mod"}
    # a prologue module whose own parameters the epilogue reads directly (Perceiver's byte head:
    # ``h @ embeddings.weight.T``) is needed, real, on the last stage as well; a parameter an
    # epilogue module holds too (a head tied to the embedding) is already there as that module's
    tied = {id(p) for n in epilogue for p in siblings[n].parameters()}
    read_late = {m for m in prologue for n, phases in recorder.reads.items()
                 if "epilogue" in phases and n.startswith(m + ".") and id(watched[n]) not in tied}
    shared = tuple(n for n in prologue if n in holders and (n in epilogue or n in read_late))
    carried = tuple(n for n in prologue if n in holders and n not in shared and (n in side or n in recorder.late))
    bare_names = set(_bare_parameters(model, spec.blocks_path))
    bare = {}
    for n, phases in recorder.reads.items():
        owner = n.rpartition(".")[0]
        if n in bare_names or not any(owner == m or owner.startswith(m + ".") for m in ran):
            bare[n] = frozenset(phases | ({"blocks"} if n in side else set()))
    # a module the prologue runs too is no epilogue module: a parameter-holding one is shared, a
    # parameter-free one (XLNet's one dropout, applied to the embeddings and to the last block's
    # output) runs for real on every stage, where dropping it broke the first stage's prologue
    return Probe(prologue=prologue, epilogue=tuple(n for n in epilogue if n not in prologue),
                 block_out=Template.of(block_out[0]), block_first_param=first_param, bare=bare,
                 shared=shared, output=Template.of(result), carried=carried)


def bare_holders(phases: frozenset[str], chunk: int, num_chunks: int) -> bool:
    """Whether chunk ``chunk`` of ``num_chunks`` runs a phase that reads a bare parameter (one read
    nowhere stays on the first chunk, so that it exists once)."""
    return ("blocks" in phases or (chunk == 0 and ("prologue" in phases or not phases))
            or (chunk == num_chunks - 1 and "epilogue" in phases))
