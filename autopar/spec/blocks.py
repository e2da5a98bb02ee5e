"""Where a model's repeated blocks are, and what runs around them.

A *block list* is an ``nn.ModuleList`` or ``nn.Sequential`` of at least two children of one class
with identical parameter shapes (the repeated transformer layers). It may sit at any depth: GPT's
``layers``, Hugging Face's ``model.layers`` / ``bert.encoder.layer``, a timm-style ViT's ``blocks``
Sequential. The model file's ``pipeline_blocks`` names one explicitly. Otherwise the list holding the
most parameters wins; a list without parameters is never one.

``probe_calls`` runs the model once on meta and records, in order, which modules beside the block
list ran before the first block (the prologue: embeddings, rotary tables) and after the last (the
epilogue: final norm, head), and how each block was called (positional or keyword arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.block_dict import BlockDict
from autopar.errors import ModelFileError

# torchtitan's numbered nn.ModuleDict of layers is a block list too (autopar/block_dict.py)
BLOCK_CONTAINERS = (nn.ModuleList, nn.Sequential, BlockDict)


def _signature(mod: nn.Module) -> tuple:
    return (type(mod),) + tuple((n, tuple(p.shape)) for n, p in mod.named_parameters())


class BlocksNotRun(ModelFileError):
    """The forward did not call every block of the list found (``blocks_path``): it is a list of
    alternatives indexed per call (Zamba2's adapter slots, one used per depth), not the model's blocks."""

    def __init__(self, message: str, blocks_path: str) -> None:
        super().__init__(message)
        self.blocks_path = blocks_path


def is_block_list(mod: nn.Module) -> bool:
    """A ModuleList or Sequential of >= 2 children that are the same block (class and shapes); a list
    of ModuleLists is not one (a ModuleList cannot be called: the forward iterates it and calls its
    children, Funnel's ``encoder.blocks``), and neither is a list inside one (it holds only part of
    the blocks; spec/chain.py reads such a model as the chain of the inner lists' children). A list
    of nn.Sequential blocks is one: a Sequential is called, as any block."""
    if not isinstance(mod, BLOCK_CONTAINERS) or len(mod) < 2:
        return False
    children = list(mod.children())
    if any(isinstance(c, nn.ModuleList) for c in children):
        return False
    first = _signature(children[0])
    return all(_signature(c) == first for c in children[1:])


def _num_params(mod: nn.Module) -> int:
    return sum(p.numel() for p in mod.parameters())


def find_block_list(model: nn.Module, declared: str | None, exclude: frozenset[str] = frozenset()) -> str | None:
    """Dotted path of the block list: ``declared`` (checked) or the largest one found, other than
    those in ``exclude`` (lists whose blocks the forward did not all call: BlocksNotRun); None if none."""
    if declared is not None:
        try:
            blocks = model.get_submodule(declared)
        except AttributeError:
            raise ModelFileError(f"pipeline_blocks = {declared!r} is not a submodule of the model") from None
        if not isinstance(blocks, BLOCK_CONTAINERS) or len(blocks) == 0:
            raise ModelFileError(
                f"pipeline_blocks = {declared!r} must name a non-empty nn.ModuleList, nn.Sequential or "
                "nn.ModuleDict keyed 0 .. n-1, "
                f"got {type(blocks).__name__}")
        if len(blocks) > 1 and not is_block_list(blocks):
            raise ModelFileError(
                f"pipeline_blocks = {declared!r} holds blocks of different classes or shapes; "
                "name a list of identical blocks")
        return declared
    best: tuple[int, str] | None = None
    inner = {f"{n}.{k}" for n, m in model.named_modules() if isinstance(m, BLOCK_CONTAINERS)
             for k, c in m.named_children() if isinstance(c, BLOCK_CONTAINERS)}
    for name, mod in model.named_modules():
        if name and name not in exclude and name not in inner and is_block_list(mod):
            size = _num_params(mod)
            # A list of parameter-free modules (Zamba2's per-layer adapter slots, nn.Identity when
            # adapters are off) holds nothing to pipeline or shard: it is no block list.
            if size and (best is None or size > best[0]):
                best = (size, name)
    if best is None:
        return None
    # Lists of lists (a hierarchical model's stages, each a list of layers whose first one differs:
    # Hiera's 2 / 6 / 36 / 4, Funnel's blocks): the one list of identical blocks may be a small
    # part of the model (Hiera-L's first stage, 0.2 % of its parameters), and taken for the blocks
    # it left the rest to be priced as an epilogue and never pipelined. Where it holds less than
    # half of what the outermost lists hold, the model is read as the chain of their units.
    # (lists of layers or stages: children of one class -- not a Sequential of an embedding and a dropout)
    outer = [(n, m) for n, m in model.named_modules()
             if n and isinstance(m, BLOCK_CONTAINERS) and len(m) >= 2 and n not in exclude
             and len({type(c) for c in m.children()}) == 1]
    names = [n for n, _ in outer]
    held = sum(_num_params(m) for n, m in outer if not any(n.startswith(o + ".") for o in names))
    return None if 2 * best[0] < held else best[1]


def heterogeneous_lists(model: nn.Module) -> list[str]:
    """ModuleLists / Sequentials whose children share a class but not their parameter shapes
    (ResNet stages of different widths): named in the message when no block list exists."""
    out = []
    for name, mod in model.named_modules():
        if name and isinstance(mod, BLOCK_CONTAINERS) and len(mod) >= 2 and not is_block_list(mod):
            if len({type(c) for c in mod.children()}) == 1:
                out.append(name)
    return out


@dataclass(frozen=True, kw_only=True)
class BlockCall:
    """How the model calls a block: positional argument count and keyword names."""

    num_args: int
    kwargs: tuple[str, ...]
    first_arg_is_tensor: bool


@dataclass(frozen=True, kw_only=True)
class Probe:
    """What one meta forward showed around the block list (see the module docstring).

    ``prologue``: names (dotted, from the root) of the modules beside the block list that ran
    before the first block, with the type of what they returned; ``epilogue``: those that ran
    after the last block. ``block_call``: how the first block was called. ``block_output``: the type
    name of what a block returned ("Tensor", "tuple", ...).
    """

    prologue: tuple[tuple[str, str], ...]
    epilogue: tuple[str, ...]
    block_call: BlockCall
    block_output: str


def siblings(model: nn.Module, blocks_path: str) -> dict[str, nn.Module]:
    """Every module beside the block list on its path from the root (the candidates for the
    prologue and epilogue)."""
    path = blocks_path.split(".")
    out: dict[str, nn.Module] = {}
    for depth in range(len(path)):
        prefix = ".".join(path[:depth])
        parent = model.get_submodule(prefix) if prefix else model
        for name, child in parent.named_children():
            if name != path[depth]:
                out[f"{prefix}.{name}" if prefix else name] = child
    return out


def _type_name(value: Any) -> str:
    return "Tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def probe_calls(model: nn.Module, blocks_path: str, run: Any) -> Probe:
    """Run ``run()`` (one meta forward of ``model``) and classify the modules around the blocks."""
    events: list[tuple[str, str, Any]] = []
    handles = []
    for name, mod in siblings(model, blocks_path).items():
        handles.append(mod.register_forward_hook(lambda m, a, o, n=name: events.append(("mod", n, _type_name(o)))))
    blocks = model.get_submodule(blocks_path)
    first, last = blocks[0], blocks[len(blocks) - 1]
    call: dict[str, Any] = {}

    def on_first(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        events.append(("first", "", None))
        call.setdefault("call", BlockCall(num_args=len(args), kwargs=tuple(sorted(kwargs)),
                                          first_arg_is_tensor=bool(args) and isinstance(args[0], torch.Tensor)))

    def on_last(mod: nn.Module, args: tuple, out: Any) -> None:
        events.append(("last", "", None))
        call.setdefault("output", _type_name(out))

    handles.append(first.register_forward_pre_hook(on_first, with_kwargs=True))
    handles.append(last.register_forward_hook(on_last))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    kinds = [e[0] for e in events]
    if "first" not in kinds or "last" not in kinds:
        which = "its blocks" if "first" not in kinds else "the last of its blocks"
        raise BlocksNotRun(f"the model's forward never called {which} ({blocks_path})", blocks_path)
    i_first, i_last = kinds.index("first"), len(kinds) - 1 - kinds[::-1].index("last")
    prologue = tuple((n, t) for i, (k, n, t) in enumerate(events) if k == "mod" and i < i_first)
    epilogue = tuple(dict.fromkeys(n for i, (k, n, _) in enumerate(events) if k == "mod" and i > i_last))
    return Probe(prologue=tuple(dict.fromkeys(prologue)), epilogue=epilogue,
                 block_call=call["call"], block_output=call.get("output", "Tensor"))
