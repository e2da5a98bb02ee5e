"""The model spec: the one owner of the facts about a user's model (DESIGN §3c).

``model_spec(model_file)`` builds the model on meta once and reads: where the repeated blocks are
(``spec.blocks``), what runs before and after them (prologue and epilogue, from one meta forward),
heads and KV heads, tied parameters, the vocabulary edges tensor parallelism shards, the TP plan and
where it came from (``spec.tp_plan``), the attention core, and for every plan dimension whether the
executor can run it on this model and, if not, why (``spec.support``, ``spec.support_reason``).
The graph (planner), the profiler and the executor all read this object; none of them has rules of
its own for blocks, heads or the TP plan. Needs torch, never torch.distributed.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autopar.errors import ModelFileError
from autopar.modelfile import ModelFile, call_model
from autopar.spec.blocks import Probe, find_block_list, heterogeneous_lists, probe_calls
from autopar.spec.meta import tolerant_meta
from autopar.spec.support import DIMENSIONS, support_of
from autopar.spec.tp_plan import TPPlan, model_carried_plan, resolve, root_prefixes

__all__ = ["DIMENSIONS", "ModelSpec", "TPPlan", "find_core", "model_spec", "spec_of_model"]

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "nhead", "num_attention_heads_per_layer")
_KV_ATTRS = ("num_kv_heads", "num_key_value_heads", "n_head_kv", "num_kv", "multi_query_group_num")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Structural facts about one model (see the module docstring). Names are dotted paths from the
    model's root, except ``tp.styles`` and ``core_name``, which are block-relative."""

    blocks_path: str
    num_blocks: int
    blocks_kind: str  # "ModuleList" | "Sequential"
    tp: TPPlan
    core_name: str | None
    num_heads: int | None
    num_kv_heads: int | None
    accepts_positions: bool
    vocab_embedding: str | None = None
    vocab_head: str | None = None
    tied: tuple[tuple[str, ...], ...] = ()
    probe: Probe | None = None
    sp_parents_keyword: tuple[str, ...] = ()  # colwise parents called with keyword-only input
    bare_params: tuple[str, ...] = ()  # parameters not inside any module the pipeline places
    inputs_are_tensors: bool = True
    inputs_are_token_batch: bool = False
    is_sequence_model: bool = False
    support: Mapping[str, str | None] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def tp_plan(self) -> Mapping[str, str] | None:
        """Block-relative name -> "colwise" | "rowwise"; None when TP is impossible."""
        return dict(self.tp.styles) or None

    def supports(self, dim: str) -> bool:
        return self.support.get(dim) is None

    def support_reason(self, dim: str) -> str | None:
        if dim not in DIMENSIONS:
            raise KeyError(f"unknown dimension {dim!r}; one of {', '.join(DIMENSIONS)}")
        return self.support.get(dim)


def _config_int(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        v = getattr(obj, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _heads(model: nn.Module, block: nn.Module) -> tuple[int | None, int | None]:
    """Heads and KV heads from the model's config, else from attributes of the block's modules
    (``nn.MultiheadAttention.num_heads``, HF attention modules)."""
    cfg = getattr(model, "config", None)
    heads = _config_int(cfg, _HEAD_ATTRS) if cfg is not None else None
    kv = _config_int(cfg, _KV_ATTRS) if cfg is not None else None
    if heads is None:
        for mod in block.modules():
            heads = heads or _config_int(mod, _HEAD_ATTRS)
            kv = kv or _config_int(mod, _KV_ATTRS)
    return heads, (kv or heads) if heads is not None else None


def find_core(block: nn.Module) -> str | None:
    """Block-relative name of the attention core: a parameter-free submodule named ``core`` or of a
    class ending in ``CoreAttention``, computing attention from (q, k, v) (None: there is none)."""
    for name, mod in block.named_modules():
        if name and (name.rsplit(".", 1)[-1] == "core" or type(mod).__name__.endswith("CoreAttention")):
            if any(True for _ in mod.parameters()):
                continue  # an attention core is parameter-free by contract
            return name
    return None


def _vocab_edges(model: nn.Module, blocks_path: str) -> tuple[str | None, str | None]:
    """The token embedding and the output head: Hugging Face's ``get_input_embeddings`` /
    ``get_output_embeddings`` when the model has them, else the nn.Embedding outside the blocks whose
    vocabulary an nn.Linear outside the blocks projects to (that Linear is the head; the largest such
    embedding wins), else the largest nn.Embedding alone (GPT's position embedding is smaller)."""
    inside = blocks_path + "."
    outside = [(n, m) for n, m in model.named_modules() if n and n != blocks_path and not n.startswith(inside)]
    names = {id(m): n for n, m in outside}
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if callable(get_in):
        try:
            e, h = get_in(), get_out() if callable(get_out) else None
        except (NotImplementedError, AttributeError):
            e = h = None
        emb = names.get(id(e)) if isinstance(e, nn.Embedding) else None
        head = names.get(id(h)) if isinstance(h, nn.Linear) else None
        if emb is not None and head is not None and h.out_features != e.num_embeddings:
            head = None
        if emb is not None:
            return emb, head
    embeddings = sorted(((m.num_embeddings, n) for n, m in outside if isinstance(m, nn.Embedding)), reverse=True)
    linears = [(n, m) for n, m in outside if isinstance(m, nn.Linear)]
    for vocab, e_name in embeddings:
        heads = [n for n, m in linears if m.out_features == vocab]
        if heads:
            return e_name, heads[-1]
    return (embeddings[0][1] if embeddings else None), None


def _tied(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return tuple(tuple(v) for v in aliases.values() if len(v) > 1)


def _bare_params(model: nn.Module, blocks_path: str, probe: Probe) -> tuple[str, ...]:
    """Parameters registered directly on the root or on an ancestor of the block list: no prologue
    or epilogue module owns them, so a pipeline chunk cannot tell which stage needs them."""
    path = blocks_path.split(".")
    out = []
    for depth in range(len(path)):
        prefix = ".".join(path[:depth])
        owner = model.get_submodule(prefix) if prefix else model
        for name, _ in owner.named_parameters(recurse=False):
            out.append(f"{prefix}.{name}" if prefix else name)
    return tuple(out)


def _tp_plan_of(mf: ModelFile, model: nn.Module, blocks_path: str, block: nn.Module) -> TPPlan:
    """The TP plan by precedence: declared, carried by the model, inferred (module docstring of
    autopar.spec.tp_plan)."""
    where = str(mf.path)
    prefixes = root_prefixes(model)
    names = frozenset(n for n, _ in model.named_modules() if n)
    if mf.tp_plan is not None:
        styles, notes = resolve(mf.tp_plan, block, blocks_path, prefixes, strict=True, where=where, model_names=names)
        return TPPlan(styles=styles, source="declared", detail="the model file's tp_plan", dropped=tuple(notes))
    carried, label = model_carried_plan(model)
    if carried is not None:
        styles, notes = resolve(carried, block, blocks_path, prefixes, strict=False, where=where, model_names=names)
        if styles:
            return TPPlan(styles=styles, source="model", detail=label, dropped=tuple(notes))
        return TPPlan(styles={}, source="none", detail=f"the model's {label} has no entry autopar can run",
                      dropped=tuple(notes))
    return TPPlan(styles={}, source="none", detail="none declared (tp_plan) or carried by the model (_tp_plan)")


def _keyword_parents(block: nn.Module, styles: Mapping[str, str], run: Any) -> tuple[str, ...]:
    """Parents of colwise layers whose forward received no positional tensor (HF attention takes
    ``hidden_states=``): the SP gather hook reads the first positional input."""
    parents = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n, s in styles.items() if s == "colwise"})
    bad: dict[str, bool] = {}
    handles = []
    for p in parents:
        if not p:
            continue
        mod = block.get_submodule(p)

        def hook(m: nn.Module, args: tuple, kwargs: dict, name: str = p) -> None:
            bad.setdefault(name, not (args and isinstance(args[0], torch.Tensor)))

        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return tuple(n for n, b in bad.items() if b)


_CACHE: dict[tuple[str, str], ModelSpec] = {}


def model_spec(mf: ModelFile, model: nn.Module | None = None) -> ModelSpec:
    """The ModelSpec of ``mf`` (cached per file and content). ``model``: an already built meta model
    of the file, to save a build."""
    key = (str(mf.path.resolve()), mf.sha256)
    if key not in _CACHE:
        _CACHE[key] = spec_of_model(mf, model if model is not None else mf.build("meta"))
    return _CACHE[key]


def spec_of_model(mf: ModelFile, model: nn.Module) -> ModelSpec:
    """Read the spec of ``model`` (built on meta from ``mf``); see the module docstring."""
    where = str(mf.path)
    try:
        blocks_path = find_block_list(model, mf.pipeline_blocks)
    except ModelFileError as exc:
        raise ModelFileError(f"{where}: {exc}") from None
    if blocks_path is None:
        mixed = heterogeneous_lists(model)
        hint = (f" ({', '.join(mixed[:3])} hold blocks of different widths)" if mixed else "")
        raise ModelFileError(
            f"{where}: found no list of repeated blocks (an nn.ModuleList or nn.Sequential of identical "
            f"blocks){hint}; set pipeline_blocks = '<attribute name>'")
    blocks = model.get_submodule(blocks_path)
    block = blocks[0]
    inputs = mf.example_inputs(1, "meta")

    def run() -> Any:
        with tolerant_meta():
            return call_model(model, inputs)

    try:
        probe = probe_calls(model, blocks_path, run)
    except ModelFileError as exc:
        raise ModelFileError(f"{where}: {exc}") from None
    except Exception as exc:  # the user's forward on meta
        raise ModelFileError(f"{where}: the model failed on the meta device: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    tp = _tp_plan_of(mf, model, blocks_path, block)
    heads, kv = _heads(model, block)
    emb, head = _vocab_edges(model, blocks_path)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    flat = tree_flatten(inputs)[0]
    tensors_only = isinstance(inputs, torch.Tensor) or (
        isinstance(inputs, tuple) and all(isinstance(v, torch.Tensor) for v in inputs))
    token_batch = isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and not inputs.is_floating_point()
    spec = ModelSpec(
        blocks_path=blocks_path, num_blocks=len(blocks), blocks_kind=type(blocks).__name__, tp=tp,
        core_name=find_core(block), num_heads=heads, num_kv_heads=kv,
        accepts_positions="positions" in params, vocab_embedding=emb, vocab_head=head, tied=_tied(model),
        probe=probe, sp_parents_keyword=_keyword_parents(block, tp.styles, run) if tp.styles else (),
        bare_params=_bare_params(model, blocks_path, probe), inputs_are_tensors=tensors_only and bool(flat),
        inputs_are_token_batch=token_batch, is_sequence_model=mf.seq_len is not None,
        notes=tp.dropped,
    )
    return _with_support(spec)


def _with_support(spec: ModelSpec) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, support=support_of(spec))
