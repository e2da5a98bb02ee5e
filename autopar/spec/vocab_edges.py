"""The vocabulary edges of a model: its token embedding and its output head, which tensor
parallelism shards by vocabulary (executor/parallel/tensor_parallel.py: ``shard_vocab_edges``).

Where a module runs decides what it can be: the token embedding turns the input into the blocks'
hidden state, so it runs before the first block (the probe's prologue); the head turns the last
block's output into logits, so it runs after the last block (the epilogue). A Linear before the
blocks whose width happens to equal a table's rows (Perceiver's cross-attention ``dense2``, 64
features beside 64 position embeddings) is no head, and sharding it would hand a vocabulary-sharded
DTensor to the blocks. Shapes alone cannot tell the two apart; the phase in which a module ran can.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from autopar.spec.blocks import Probe


def _in_phase(name: str, module: nn.Module, phase: frozenset[str], holders: dict[int, list[str]]) -> bool:
    """Whether ``module`` (named ``name``) ran in ``phase`` (module names of one side of the blocks):
    it, or a module around it, is listed there; or its weight is held by a module listed there (a
    shared table the model reaches through another module: BART's ``model.shared``, looked up as the
    encoder's ``embed_tokens``)."""
    if any(name == p or name.startswith(p + ".") for p in phase):
        return True
    weight = getattr(module, "weight", None)
    return any(any(h == p or h.startswith(p + ".") for p in phase) for h in holders.get(id(weight), ()))


def vocab_edges(model: nn.Module, blocks_path: str, probe: Probe | None) -> tuple[str | None, str | None]:
    """The token embedding and the output head (dotted names, None where there is none).

    Candidates: the model's own ``get_input_embeddings`` / ``get_output_embeddings`` (Hugging Face)
    when the first is an nn.Embedding; else the nn.Embedding whose vocabulary an nn.Linear projects
    to (that Linear is the head; the largest such embedding wins); else the largest nn.Embedding
    alone (GPT's position table is smaller than its vocabulary). Only modules outside the blocks
    count, and with a ``probe`` only an embedding that ran before the blocks and a head that ran
    after them (module docstring); without one (a chain whose forward was not read) every module
    outside the blocks may be either.
    """
    inside = blocks_path + "."
    outside = [(n, m) for n, m in model.named_modules() if n and n != blocks_path and not n.startswith(inside)]
    if probe is not None:
        holders: dict[int, list[str]] = {}
        for n, m in model.named_modules(remove_duplicate=False):
            if isinstance(getattr(m, "weight", None), nn.Parameter):
                holders.setdefault(id(m.weight), []).append(n)
        before = frozenset(n for n, _ in probe.prologue)
        after = frozenset(probe.epilogue)
        inputs = [(n, m) for n, m in outside if _in_phase(n, m, before, holders)]
        outputs = [(n, m) for n, m in outside if _in_phase(n, m, after, holders)]
    else:
        inputs = outputs = outside
    in_names, out_names = {id(m): n for n, m in inputs}, {id(m): n for n, m in outputs}
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if callable(get_in):
        try:
            e, h = get_in(), get_out() if callable(get_out) else None
        except (NotImplementedError, AttributeError):
            e = h = None
        emb = in_names.get(id(e)) if isinstance(e, nn.Embedding) else None
        head = out_names.get(id(h)) if isinstance(h, nn.Linear) else None
        if emb is not None and head is not None and h.out_features != e.num_embeddings:
            head = None
        if emb is not None:
            return emb, head
    embeddings = sorted(((m.num_embeddings, n) for n, m in inputs if isinstance(m, nn.Embedding)), reverse=True)
    linears = [(n, m) for n, m in outputs if isinstance(m, nn.Linear)]
    for vocab, e_name in embeddings:
        heads = [n for n, m in linears if m.out_features == vocab]
        if heads:
            return e_name, heads[-1]
    return (embeddings[0][1] if embeddings else None), None


class _LateReads(TorchFunctionMode):
    """Notes whether a torch function takes ``weight`` while ``late()`` says the forward is past the
    blocks and outside the head module."""

    def __init__(self, weight: torch.Tensor, late: Callable[[], bool]) -> None:
        super().__init__()
        self.weight, self.late, self.seen = weight, late, False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if not self.seen and self.late() and any(v is self.weight for v in tree_flatten((args, kwargs))[0]):
            self.seen = True
        return func(*args, **kwargs)


def embedding_read_late(model: nn.Module, embedding: str, head: str | None, last: nn.Module,
                        run: Callable[[], Any]) -> bool:
    """Whether the model's code reads the token embedding's weight itself after the last block
    (``last``), other than inside the head module: a byte head computing ``h @ embeddings.weight.T``
    (Perceiver IO). A vocabulary-sharded table would meet a replicated activation in that product,
    which DTensor refuses, so such an embedding stays replicated under tensor parallelism.
    ``run``: one meta forward of ``model``; a forward that fails here reads nothing late (the
    spec's own probe already ran it)."""
    weight = model.get_submodule(embedding).weight
    state = {"after": False, "head": 0}
    reads = _LateReads(weight, lambda: state["after"] and not state["head"])

    def before_last(m: nn.Module, a: tuple) -> None:
        # a shared unit runs at every depth: only what follows its last call is after the blocks
        state.update(after=False)
        reads.seen = False

    handles = [last.register_forward_pre_hook(before_last),
               last.register_forward_hook(lambda m, a, o: state.update(after=True))]
    if head is not None:
        head_mod = model.get_submodule(head)
        # first among the head's pre-hooks: what its other hooks read (autopar.input_cast reads
        # its weight's dtype) is read inside the head
        handles += [head_mod.register_forward_pre_hook(lambda m, a: state.update(head=state["head"] + 1), prepend=True),
                    head_mod.register_forward_hook(lambda m, a, o: state.update(head=state["head"] - 1))]
    try:
        with torch.no_grad(), reads:
            run()
    except Exception:  # noqa: BLE001 - the user's forward on meta, already run by the spec's probe
        return False
    finally:
        for h in handles:
            h.remove()
    return reads.seen
