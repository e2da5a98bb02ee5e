"""What the executor needs to know about a user's model, read from the meta-device build.

Nothing here allocates memory or touches torch.distributed: ``inspect_model`` runs before the
process group exists so a wrong plan fails fast with a one-line ``AutoparError`` (no hang).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from autopar.errors import AutoparError, ModelFileError
from autopar.modelfile import ModelFile


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Structural facts about a model, block-relative where it says so.

    ``blocks_path``: dotted path of the ModuleList of repeated blocks (what pipelining cuts).
    ``tp_plan``: block-relative submodule name -> "colwise" | "rowwise" (None: TP impossible).
    ``core_name``: block-relative name of the attention core, a parameter-free submodule computing
    causal softmax attention from (q, k, v) of shape (b, heads, s, d) (None: no CP, no selective
    recompute). ``accepts_positions``: ``forward`` takes ``positions=`` (needed by CP).
    ``vocab_embedding`` / ``vocab_head``: dotted names (from the root, outside the blocks) of the
    token embedding (an nn.Embedding) and the output head (an nn.Linear whose out_features is the
    embedding's vocabulary), which tensor parallelism shards by vocabulary; None when not found.
    """

    blocks_path: str
    num_blocks: int
    tp_plan: Mapping[str, str] | None
    core_name: str | None
    num_heads: int | None
    num_kv_heads: int | None
    accepts_positions: bool
    vocab_embedding: str | None = None
    vocab_head: str | None = None


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path) if path else root


def _find_blocks(model: nn.Module, declared: str | None, where: str) -> str:
    if declared is not None:
        try:
            blocks = model.get_submodule(declared)
        except AttributeError:
            raise ModelFileError(f"{where}: pipeline_blocks = {declared!r} is not a submodule of the model") from None
        if not isinstance(blocks, nn.ModuleList):
            raise ModelFileError(f"{where}: pipeline_blocks = {declared!r} must name an nn.ModuleList")
        return declared
    # Infer: the largest ModuleList whose members all share one class (the repeated block).
    best, best_len = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > best_len and len({type(m) for m in mod}) == 1:
            best, best_len = name, len(mod)
    if best is None:
        raise ModelFileError(f"{where}: no ModuleList of repeated blocks found; set pipeline_blocks = '<name>'")
    return best


def _known_tp_plan(model: nn.Module, blocks_path: str) -> Mapping[str, str] | None:
    """TP plan for models that carry one: reference models, or Hugging Face ``_tp_plan``."""
    from autopar.models.gpt import GPT, GPT_TP_PLAN
    from autopar.models.llama import LLAMA_TP_PLAN, Llama

    if isinstance(model, GPT):
        return GPT_TP_PLAN
    if isinstance(model, Llama):
        return LLAMA_TP_PLAN
    hf = getattr(model, "_tp_plan", None) or getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if isinstance(hf, Mapping):
        prefix = f"{blocks_path}.*."
        short = blocks_path.rsplit(".", 1)[-1] + ".*."
        out = {}
        for pattern, style in hf.items():
            for p in (prefix, short):
                if pattern.startswith(p) and style in ("colwise", "rowwise"):
                    out[pattern[len(p):]] = style
        return out or None
    return None


def _find_core(block: nn.Module) -> str | None:
    for name, mod in block.named_modules():
        if name and (name.rsplit(".", 1)[-1] == "core" or type(mod).__name__.endswith("CoreAttention")):
            if any(True for _ in mod.parameters()):
                continue  # an attention core is parameter-free by contract
            return name
    return None


def _heads(model: nn.Module) -> tuple[int | None, int | None]:
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_heads", None) or getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_kv_heads", None) or getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv


def _vocab_edges(model: nn.Module, blocks_path: str) -> tuple[str | None, str | None]:
    """The token embedding and the output head: Hugging Face's ``get_input_embeddings`` /
    ``get_output_embeddings`` when the model has them, else the nn.Embedding outside the blocks whose
    vocabulary an nn.Linear outside the blocks projects to (that Linear is the head; the largest such
    embedding wins), else the largest nn.Embedding alone (GPT's position embedding is smaller)."""
    inside = blocks_path + "."
    outside = [(n, m) for n, m in model.named_modules() if n and n != blocks_path and not n.startswith(inside)]
    names = {id(m): n for n, m in outside}
    emb = head = None
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


def inspect_model(mf: ModelFile, model: nn.Module) -> ModelSpec:
    """Read the ModelSpec of ``model`` (built on meta from ``mf``)."""
    where = str(mf.path)
    blocks_path = _find_blocks(model, mf.pipeline_blocks, where)
    blocks = model.get_submodule(blocks_path)
    tp_plan: Mapping[str, str] | None = None
    if mf.tp_plan is not None:
        tp_plan = {k: v for k, v in mf.tp_plan.items() if v in ("colwise", "rowwise")}
    else:
        tp_plan = _known_tp_plan(model, blocks_path)
    if tp_plan:
        for name in tp_plan:
            try:
                sub = blocks[0].get_submodule(name)
            except AttributeError:
                raise ModelFileError(f"{where}: tp_plan names {name!r}, which is not a submodule of a block") from None
            if not isinstance(sub, nn.Linear):
                raise ModelFileError(f"{where}: tp_plan[{name!r}] must name an nn.Linear, got {type(sub).__name__}")
    heads, kv = _heads(model)
    vocab = _vocab_edges(model, blocks_path)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return ModelSpec(
        blocks_path=blocks_path,
        num_blocks=len(blocks),
        tp_plan=tp_plan or None,
        core_name=_find_core(blocks[0]) if len(blocks) else None,
        num_heads=heads,
        num_kv_heads=kv,
        accepts_positions="positions" in params,
        vocab_embedding=vocab[0],
        vocab_head=vocab[1],
    )


def example_shape_check(inputs: Any, where: str, need_sequence: bool) -> None:
    """PP needs tensor / tuple-of-tensor inputs; CP additionally a (batch, seq) token tensor."""
    if need_sequence and not (hasattr(inputs, "dim") and inputs.dim() == 2):
        raise AutoparError(
            f"{where}: context parallelism needs example_inputs() to return one (batch, seq) token tensor"
        )
