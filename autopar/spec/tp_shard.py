"""A model's tensor-parallel plan applied to its shapes on the meta device: one tp rank's copy.

What the executor's DTensor plan does to parameter shapes (executor/parallel/tensor_parallel.py), without
a process group: a colwise Linear (or Hugging Face ``Conv1D``) keeps 1/tp of its outputs, a rowwise
one 1/tp of its inputs, the token embedding and output head 1/tp of the vocabulary, and the
block's ``local_attrs`` (head counts the attention reads) are divided by tp. The spec's checks of
an inferred plan (spec/tp_infer.py), the trace of a tp rank's block (graph/measure.py) and the
layer profiler (profiler/layers.py) build their rank copies here.
"""

from __future__ import annotations

import copy
import fnmatch
from typing import Mapping

import torch
from torch import nn

from autopar.spec.module_copy import copy_module
from autopar.spec.tp_plan import is_tp_linear, set_local_attrs


def match_tp_style(block_relative_name: str, tp_plan: Mapping[str, str], blocks_attr: str) -> str | None:
    """The tp_plan style of a submodule of a block. Patterns may be block-relative ("attn.qkv")
    or model-relative with a wildcard index ("layers.*.attn.qkv", as Hugging Face writes them)."""
    full = f"{blocks_attr}.0.{block_relative_name}"
    for pattern, style in tp_plan.items():
        if fnmatch.fnmatchcase(block_relative_name, pattern) or fnmatch.fnmatchcase(full, pattern.replace(".*.", ".0.")):
            return style
    return None


def localise_vocab_constants(model: nn.Module, vocab: int, tp: int) -> int:
    """Divide by tp the integer vocabulary sizes ``model``'s code reads besides its layers' shapes:
    attributes named ``*vocab*`` holding the vocabulary, on its modules and on their ``config``
    (Hugging Face's label loss views the logits by ``config.vocab_size``). On a tp rank's meta copy
    (``shard_for_tp(..., vocab_constants=True)``) such code then runs on the rank's vocabulary slice,
    as the executor's vocab-parallel loss does on its DTensor logits of the global shape; returns how
    many changed. Call on a copy: a config object is shared by the modules holding it."""
    holders = {id(o): o for m in model.modules() for o in (m, getattr(m, "config", None)) if o is not None}
    changed = 0
    for obj in holders.values():
        for name, value in list(vars(obj).items()):
            if "vocab" in name.lower() and type(value) is int and value == vocab:
                try:
                    setattr(obj, name, vocab // tp)
                except (AttributeError, TypeError, ValueError):  # a frozen config: left as it is
                    continue
                changed += 1
    return changed


# (token embedding, output head): the dotted names the spec found (ModelSpec.vocab_embedding /
# vocab_head, spec/vocab_edges.py), None where there is none
Edges = tuple[str | None, str | None]


def _edge(model: nn.Module, name: str | None, kind: type) -> nn.Module | None:
    try:
        mod = model.get_submodule(name) if name else None
    except AttributeError:
        return None
    return mod if isinstance(mod, kind) else None


def vocab_size_of(model: nn.Module, edges: Edges | None = None) -> int | None:
    """The vocabulary tensor parallelism shards: with the spec's ``edges``, the token embedding's rows,
    else the head's outputs (None: neither, nothing is sharded by vocabulary); without them the
    largest nn.Embedding's rows."""
    if edges is not None:
        emb, head = _edge(model, edges[0], nn.Embedding), _edge(model, edges[1], nn.Linear)
        return emb.num_embeddings if emb is not None else (head.out_features if head is not None else None)
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(sizes) if sizes else None


def _narrowed(mod: nn.Module, style: str, tp: int) -> nn.Module:
    """A meta layer of ``mod``'s kind with one tp rank's width: nn.Linear (weight (out, in)) or HF's
    ``Conv1D`` (weight (in, out), ``nf`` / ``nx`` its widths, read by its forward)."""
    if isinstance(mod, nn.Linear):
        in_f, out_f = (mod.in_features, mod.out_features // tp) if style == "colwise" else (mod.in_features // tp, mod.out_features)
        return nn.Linear(in_f, out_f, bias=mod.bias is not None, device="meta", dtype=mod.weight.dtype)
    new = copy.copy(mod)  # Conv1D: same class and attributes, fresh parameters
    new._parameters = dict(mod._parameters)  # type: ignore[attr-defined]
    nx, nf = mod.weight.shape
    nx, nf = (nx, nf // tp) if style == "colwise" else (nx // tp, nf)
    new.weight = nn.Parameter(torch.empty(nx, nf, device="meta", dtype=mod.weight.dtype))
    if getattr(mod, "bias", None) is not None:
        width = nf if style == "colwise" else mod.bias.shape[0]
        new.bias = nn.Parameter(torch.empty(width, device="meta", dtype=mod.bias.dtype))
    if hasattr(new, "nf"):
        new.nf, new.nx = nf, nx
    return new


def shard_block_for_tp(block: nn.Module, tp_plan: Mapping[str, str], tp: int, local_attrs: tuple[str, ...] = (),
                       blocks_attr: str = "") -> nn.Module:
    """``block`` (changed in place and returned) with its tp-planned Linear / Conv1D layers at one tp
    rank's width and its ``local_attrs`` divided by tp."""
    for name, mod in list(block.named_modules()):
        style = match_tp_style(name, tp_plan, blocks_attr) if name else None
        if style not in ("colwise", "rowwise") or not is_tp_linear(mod):
            continue
        parent_name, _, leaf = name.rpartition(".")
        setattr(block.get_submodule(parent_name) if parent_name else block, leaf, _narrowed(mod, style, tp))
    set_local_attrs(block, local_attrs, tp)
    return block


def shard_for_tp(model: nn.Module, blocks_attr: str, tp_plan: Mapping[str, str], tp: int,
                 local_attrs: tuple[str, ...] = (), *, vocab: bool = True, vocab_constants: bool = False,
                 edges: Edges | None = None) -> nn.Module:
    """A meta copy whose first block's Linear layers and vocabulary edges hold 1/tp of their width,
    as each tensor-parallel rank of the executor holds them: the token embedding vocab/tp rows, the
    output head vocab/tp output columns (executor/parallel/tensor_parallel.py), a tied embedding/head weight
    still one parameter. A vocabulary that tp does not divide stays whole, as the executor keeps
    such edges replicated; ``vocab=False`` keeps the edges whole regardless. Only shapes matter on
    meta. HF ``Conv1D`` layers shard like Linear layers (their weight is transposed);
    ``local_attrs`` (TPPlan.local_attrs) are divided by tp; ``vocab_constants``: the model's integer
    vocabulary attributes too (``localise_vocab_constants``), where the edges are sharded.
    ``edges``: the spec's token embedding and head, the only edges the executor shards (with the
    modules holding their weights: a tied lookup); the logits, their buffers and the vocabulary
    attributes are a rank's slice only where the head is sharded. None: every nn.Embedding and
    nn.Linear outside the blocks as large as the largest table."""
    sharded = copy_module(model)
    shard_block_for_tp(sharded.get_submodule(blocks_attr)[0], tp_plan, tp, local_attrs, blocks_attr)
    if not vocab:
        return sharded
    vocab = vocab_size_of(sharded, edges)
    if vocab is not None and vocab % tp == 0:
        chosen = None if edges is None else {id(m.weight) for m in (_edge(sharded, edges[0], nn.Embedding),
                                                                   _edge(sharded, edges[1], nn.Linear)) if m is not None}
        new_by_old: dict[int, nn.Parameter] = {}  # id(old weight) -> its sharded replacement (ties)
        for name, mod in list(sharded.named_modules()):
            if name.startswith(blocks_attr + ".") or name == blocks_attr:
                continue
            if chosen is not None and id(getattr(mod, "weight", None)) not in chosen:
                continue  # not an edge the executor shards, nor tied to one
            new: nn.Module | None = None
            if isinstance(mod, nn.Embedding) and mod.num_embeddings == vocab:
                new = nn.Embedding(vocab // tp, mod.embedding_dim, device="meta", dtype=mod.weight.dtype)
            elif isinstance(mod, nn.Linear) and mod.out_features == vocab:
                new = nn.Linear(mod.in_features, vocab // tp, bias=mod.bias is not None, device="meta", dtype=mod.weight.dtype)
            if new is None:
                continue
            tied = new_by_old.get(id(mod.weight))
            if tied is not None and tied.shape == new.weight.shape:
                new.weight = tied  # a tied embedding/head stays one parameter, as on a tp rank
            new_by_old[id(mod.weight)] = new.weight
            parent_name, _, leaf = name.rpartition(".")
            setattr(sharded.get_submodule(parent_name) if parent_name else sharded, leaf, new)
        # a vocabulary bias added to the logits (BART's final_logits_bias): the executor's replicated
        # DTensor meets the logits as the rank's slice
        logits_sharded = edges is None or _edge(model, edges[1], nn.Linear) is not None
        for mod, bname, buf in vocab_buffers(sharded, blocks_attr, vocab) if logits_sharded else ():
            mod.register_buffer(bname, buf[..., : vocab // tp].clone(),
                                persistent=bname not in mod._non_persistent_buffers_set)
        if vocab_constants and logits_sharded:
            localise_vocab_constants(sharded, vocab, tp)
    return sharded


def vocab_buffers(model: nn.Module, blocks_attr: str | None, vocab: int) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, buffer) of the float buffers over the vocabulary (last dimension ``vocab``)
    outside the blocks -- a bias added to the logits (BART's ``final_logits_bias``), which a tp rank
    meets as its vocabulary shard."""
    found = []
    for path, mod in model.named_modules():
        if blocks_attr and (path == blocks_attr or path.startswith(blocks_attr + ".")):
            continue
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dim() and buf.shape[-1] == vocab:
                found.append((mod, name, buf))
    return found
