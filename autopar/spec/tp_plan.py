"""The tensor-parallel plan of a model and where it came from.

A TP plan maps block-relative submodule names to ``"colwise"`` or ``"rowwise"`` (Megatron's column-
and row-parallel Linear layers). Sources, in order of precedence:

1. ``declared``: the model file's ``tp_plan``. Patterns are block-relative (``"attn.qkv"``) or
   model-relative with a wildcard index, as Hugging Face writes them (``"layers.*.attn.qkv"``);
2. ``model``: the model's own ``_tp_plan`` (autopar's reference models carry one, as HF models do),
   then its ``config.base_model_tp_plan`` (HF, relative to the base model);
3. ``inferred``: read off the traced block's data flow (``autopar.spec.tp_infer``).

Hugging Face styles are mapped to the two autopar runs: ``colwise``, ``colwise_rep``,
``packed_colwise`` -> colwise (a packed/fused projection is recognised by its width, as
executor/parallel/tensor_parallel.py does); ``rowwise``, ``rowwise_rep`` -> rowwise. Entries autopar does not
run (expert weights, ``local_*``, ``gather``, ``ep_router``, ``sequence_parallel``, targets that are
not Linear layers) are dropped with a note; a parent whose colwise or rowwise half is dropped loses
the other half too, since a lone column-parallel layer would hand a sharded tensor to unsharded code.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import nn

from autopar.errors import ModelFileError

STYLE_MAP = {"colwise": "colwise", "colwise_rep": "colwise", "packed_colwise": "colwise",
             "rowwise": "rowwise", "rowwise_rep": "rowwise"}
SOURCES = ("declared", "model", "inferred")


@dataclass(frozen=True, kw_only=True)
class ReplicatedFlow:
    """What a block's data flow under its TP plan shows about the parameters it leaves whole on
    every tp rank (spec/tp_replicated.py; block-relative parameter names, in block order).
    ``on_shard``: those an op uses on a tp shard without SP, ``on_shard_sp``: under SP -- their
    gradient needs a sum over tp, the others' is full on every rank; ``not_norms``: those of either
    outside a norm (spec/sp_check.is_norm), whose sum the executor has no way to add;
    ``leak``/``leak_sp``: why some replicated parameter would train on a partial gradient no sum of
    a parameter fixes (one line), None when none would."""

    on_shard: tuple[str, ...] = ()
    on_shard_sp: tuple[str, ...] = ()
    not_norms: tuple[str, ...] = ()
    leak: str | None = None
    leak_sp: str | None = None

    def shard_norms(self, sequence_parallel: bool) -> tuple[str, ...]:
        """The norms (module names) whose gradient the executor sums over tp (DTensor's ``SequenceParallel``)."""
        on = self.on_shard_sp if sequence_parallel else self.on_shard
        return tuple(dict.fromkeys(_parent(p) for p in on if p not in self.not_norms))

    def reason(self, sequence_parallel: bool, exempt: tuple[str, ...] = ()) -> str | None:
        """Why the executor cannot train the replicated parameters right (one line), or None.
        ``exempt``: modules computing on the shard that reduce their gradients elsewhere (a mixture
        of experts' under SP: spec/sp_check.shard_local_modules)."""
        leak = self.leak_sp if sequence_parallel else self.leak
        if leak is not None:
            return leak
        for name in self.on_shard_sp if sequence_parallel else self.on_shard:
            if name not in self.not_norms or any(name.startswith(e + ".") for e in exempt):
                continue
            if sequence_parallel:
                return (f"{name} is in neither a tensor-parallel layer nor a norm: under sequence parallelism each "
                        "tp rank would compute with it on its own sequence shard")
            return (f"{name} is in neither a tensor-parallel layer nor a norm and computes on each tp rank's "
                    "shard of the heads: each rank would train it on its own heads' share of the gradient")
        return None


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """A block-relative TP plan and its provenance. ``styles`` is empty when TP is impossible."""

    styles: Mapping[str, str]
    source: str  # one of SOURCES, or "none"
    detail: str = ""  # e.g. "config.base_model_tp_plan", or why inference found nothing
    dropped: tuple[str, ...] = field(default=())  # notes on entries left out
    # colwise name -> number of projections it stacks (fused qkv = 3), when the data flow showed it;
    # empty: the executor infers fusion from widths (executor/tensor_parallel.fused_factors)
    fused: Mapping[str, int] = field(default_factory=dict)
    # block-relative integer attributes ("attn.split_size") each tp rank divides by tp: code that
    # splits a sharded projection with a fixed width (autopar.spec.tp_infer)
    local_attrs: tuple[str, ...] = ()
    # replicated Linear name -> how many of its last output features reach every rank's sharded
    # heads directly, not through a column-parallel layer, so that each rank's gradient of them is
    # a partial sum the executor adds up over the tp ranks in backward (``grad_sums_of``)
    grad_sums: Mapping[str, int] = field(default_factory=dict)
    # which replicated modules compute on a tp shard (their gradient summed over tp), read off the
    # block's data flow (spec/tp_replicated.py); None: not read (the executor's plain rules apply)
    flow: ReplicatedFlow | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES + ("none",):
            raise ValueError(f"TPPlan.source must be one of {SOURCES + ('none',)}, got {self.source!r}")
        for name, style in self.styles.items():
            if style not in ("colwise", "rowwise"):
                raise ValueError(f"TPPlan style of {name!r} must be colwise or rowwise, got {style!r}")
        for name, k in self.fused.items():
            if self.styles.get(name) != "colwise" or not isinstance(k, int) or k < 1:
                raise ValueError(f"TPPlan.fused[{name!r}] = {k!r}: must be a colwise layer and a count >= 1")
        for name, k in self.grad_sums.items():
            if name in self.styles or not isinstance(k, int) or k < 1:
                raise ValueError(f"TPPlan.grad_sums[{name!r}] = {k!r}: must be a replicated layer and a count >= 1")

    def describe(self) -> str:
        if not self.styles:
            return f"none ({self.detail})" if self.detail else "none"
        src = self.source + (f": {self.detail}" if self.detail else "")
        return f"{len(self.styles)} layers ({src})"


def is_tp_linear(mod: nn.Module) -> bool:
    """A layer the executor can shard by rows or columns: nn.Linear, or HF's Conv1D (transposed)."""
    return isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D"


def _matches(pattern: str, name: str, prefixes: tuple[str, ...]) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or any(fnmatch.fnmatchcase(p + name, pattern) for p in prefixes)


def _match(patterns: Mapping[str, str], names: list[str], prefixes: tuple[str, ...]) -> dict[str, str]:
    """Block-relative name -> raw style for every block submodule a pattern matches. A name is
    tried block-relative and as ``<blocks path>.0.<name>`` for each form of the blocks' path (from
    the root, or from the base model)."""
    out: dict[str, str] = {}
    for name in names:
        for pattern, style in patterns.items():
            if _matches(pattern, name, prefixes):
                out[name] = style
                break
    return out


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def resolve(patterns: Mapping[str, Any], block: nn.Module, blocks_path: str, root_prefixes: tuple[str, ...],
            *, strict: bool, where: str, model_names: frozenset[str] = frozenset()) -> tuple[dict[str, str], list[str]]:
    """Turn a pattern plan into block-relative colwise/rowwise styles; returns (styles, notes).

    ``strict`` (a declared plan): a pattern that matches no module of the model, or names a block
    layer that cannot be sharded, is an error; otherwise such entries are dropped with a note.
    Entries for modules outside the blocks (embedding, head) are noted and left to the executor,
    which shards the vocabulary edges itself. ``model_names``: every module name of the model."""
    names = [n for n, _ in block.named_modules() if n]
    prefixes = tuple(f"{form}.0." for form in strip_prefixes(blocks_path, root_prefixes))
    raw = _match(patterns, names, prefixes)
    if strict:
        for pattern in patterns:
            if any(_matches(pattern, n, prefixes) for n in names):
                continue
            if not any(fnmatch.fnmatchcase(form, pattern) for n in model_names for form in strip_prefixes(n, root_prefixes)):
                raise ModelFileError(f"{where}: tp_plan names {pattern!r}, which is not a submodule of the model")
    styles: dict[str, str] = {}
    notes: list[str] = []
    for name, style in raw.items():
        mapped = STYLE_MAP.get(str(style))
        mod = block.get_submodule(name)
        if mapped is None:
            if strict and style not in ("replicate", "sequence_parallel"):
                raise ModelFileError(f"{where}: tp_plan[{name!r}] = {style!r}; use colwise or rowwise")
            notes.append(f"{name}: style {style!r} is not run by autopar")
            continue
        if not is_tp_linear(mod):
            if strict:
                raise ModelFileError(f"{where}: tp_plan[{name!r}] must name an nn.Linear, got {type(mod).__name__}")
            notes.append(f"{name}: {type(mod).__name__} is not a Linear layer")
            continue
        styles[name] = mapped
    # A parent keeps its TP only as a whole column->row pair.
    by_parent: dict[str, set[str]] = {}
    for name, style in styles.items():
        by_parent.setdefault(_parent(name), set()).add(style)
    dropped_parents = {p for p, kinds in by_parent.items() if kinds != {"colwise", "rowwise"}}
    if dropped_parents and not strict:
        for p in sorted(dropped_parents):
            notes.append(f"{p or '(block)'}: no column->row pair left; kept replicated")
        styles = {n: s for n, s in styles.items() if _parent(n) not in dropped_parents}
    return styles, notes


# Hugging Face styles of a replicated layer some of whose last output features feed every rank's
# sharded attention heads directly -> the config attribute giving how many (transformers'
# MlaKvAProjParallel: multi-head latent attention's ``kv_a_proj_with_mqa`` ends with the rotary key
# that all heads share, which bypasses the column-parallel ``kv_b_proj``; without the sum each rank
# would train it on its own heads' gradient only).
GRAD_SUM_STYLES = {"mla_kv_a_proj": "qk_rope_head_dim"}


def grad_sums_of(patterns: Mapping[str, Any], block: nn.Module, blocks_path: str, root_prefixes: tuple[str, ...],
                 config: Any) -> tuple[dict[str, int], list[str]]:
    """(TPPlan.grad_sums, names whose width the config does not give) of a carried plan's
    ``GRAD_SUM_STYLES`` entries that name a Linear layer of ``block``."""
    names = [n for n, _ in block.named_modules() if n]
    prefixes = tuple(f"{form}.0." for form in strip_prefixes(blocks_path, root_prefixes))
    sums: dict[str, int] = {}
    missing: list[str] = []
    for name, style in _match(patterns, names, prefixes).items():
        attr = GRAD_SUM_STYLES.get(str(style))
        if attr is None or not is_tp_linear(block.get_submodule(name)):
            continue
        width = getattr(config, attr, None)
        if isinstance(width, int) and not isinstance(width, bool) and width >= 1:
            sums[name] = width
        else:
            missing.append(f"{name} ({style}: config.{attr})")
    return sums, missing


def packed_names(patterns: Mapping[str, Any], block: nn.Module, blocks_path: str,
                 root_prefixes: tuple[str, ...]) -> frozenset[str]:
    """Block-relative names a pattern plan marks ``packed_colwise``: projections stacked one after
    another on the output dim (Megatron's permutation applies). A plain ``colwise`` of a carried
    (Hugging Face) plan is sharded as laid out: HF writes ``colwise`` for fused projections that are
    already interleaved by head (GPT-NeoX's query_key_value, viewed as (heads, 3 * head_dim))."""
    names = [n for n, _ in block.named_modules() if n]
    prefixes = tuple(f"{form}.0." for form in strip_prefixes(blocks_path, root_prefixes))
    return frozenset(n for n, s in _match(patterns, names, prefixes).items() if s == "packed_colwise")


def model_carried_plan(model: nn.Module) -> tuple[Mapping[str, Any] | None, str]:
    """The TP plan a model carries itself, with its detail label: ``_tp_plan`` entries that reach
    into the blocks, else ``config.base_model_tp_plan`` (Hugging Face)."""
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and any("." in k for k in own):
        return own, "_tp_plan"
    cfg = getattr(model, "config", None)
    base = getattr(cfg, "base_model_tp_plan", None)
    if isinstance(base, Mapping) and base:
        return base, "config.base_model_tp_plan"
    return None, ""


def root_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Prefixes under which a model-relative pattern may be written: the root itself and, for HF
    models, the base model (``base_model_prefix``, e.g. ``model.``)."""
    base = getattr(model, "base_model_prefix", None)
    out = ("",)
    if isinstance(base, str) and base and hasattr(model, base):
        out += (f"{base}.",)
    return out


def strip_prefixes(path: str, prefixes: tuple[str, ...]) -> list[str]:
    """``path`` and its forms with each root prefix removed (HF patterns omit the base model)."""
    out = [path]
    for p in prefixes:
        if p and path.startswith(p):
            out.append(path[len(p):])
    return out


def set_local_attrs(block: nn.Module, local_attrs: tuple[str, ...], tp: int) -> None:
    """Divide each named integer attribute of ``block`` by tp (TPPlan.local_attrs: code that splits a
    sharded projection with a fixed width, HF GPT-2's ``split_size``)."""
    for path in local_attrs:
        owner_name, _, attr = path.rpartition(".")
        owner = block.get_submodule(owner_name) if owner_name else block
        setattr(owner, attr, getattr(owner, attr) // tp)


def fused_factors(block: nn.Module, tp_plan: Mapping[str, str], known: Mapping[str, int] | None = None,
                  *, width_fallback: bool = False) -> dict[str, int]:
    """Block-relative colwise name -> number of fused projections it stacks (1 = not fused).
    ``known``: the factors the data flow showed (an inferred plan, TPPlan.fused) or the model's own
    plan fixed (a carried plan's plain colwise layers); a name it lacks is 1, or with
    ``width_fallback`` follows the width rule: a colwise layer k times as wide as its rowwise
    partner's input is taken to stack k."""
    if known is not None and not width_fallback:
        return {n: known.get(n, 1) for n, s in tp_plan.items() if s == "colwise"}
    if known is not None:
        by_width = fused_factors(block, tp_plan)
        return {n: known.get(n, k) for n, k in by_width.items()}
    rowwise = [n for n, s in tp_plan.items() if s == "rowwise"]
    out: dict[str, int] = {}
    for name, style in tp_plan.items():
        if style != "colwise":
            continue
        width = _widths(block.get_submodule(name))[1]
        partners = [r for r in rowwise if _parent(r) == _parent(name)] or rowwise
        k = 1
        if partners:
            partner_in = _widths(block.get_submodule(partners[0]))[0]
            if width > partner_in and width % partner_in == 0:
                k = width // partner_in
        out[name] = k
    return out


def _widths(mod: nn.Module) -> tuple[int, int]:
    """(in, out) features of an nn.Linear or an HF Conv1D (weight (in, out))."""
    return (mod.in_features, mod.out_features) if isinstance(mod, nn.Linear) else tuple(mod.weight.shape)


def plan_fused(block: nn.Module, plan: TPPlan) -> dict[str, int]:
    """The fused factors the executor shards ``plan`` with (fused_factors): an inferred plan's
    data-flow counts; a carried plan's plain colwise layers as laid out, its packed ones by width;
    a declared plan by width."""
    known = plan.fused if plan.source in ("inferred", "model") else None
    return fused_factors(block, plan.styles, known, width_fallback=plan.source == "model")
