"""Tensor-parallel plans for models that declare none: column->row pairs read off the data flow.

``infer_tp(model, block, run)`` follows block 0's data flow (``autopar.spec.tp_flow``) and groups
Linear layers into Megatron pairs: the layers whose outputs reach one row layer (q, k, v -> o; a fused
qkv -> o; gate, up -> down; fc1 -> fc2), each group valid only when no source's sharded feature dim
is reduced, indexed or mixed on the way and nothing of it escapes the block. Module names play no
part. Every group is then *checked by running it sharded* before it is offered:

* on meta, block 0 with the group's Linear layers at tp = 2 widths (spec/tp_shard.shard_block_for_tp)
  must run on the block's real inputs (shapes);
* on CPU, when the block is small enough, a simulated 2-way split: two threads each run a copy of
  the block holding one rank's slice of every pair (fused projections permuted as the executor
  permutes them), their row layers' partial outputs summed between them (the all-reduce); both
  must give the full block's output (float64, ``_RTOL``).

A group that fails is left out with its reason. A block whose attention splits with fixed integer
attributes (HF GPT-2's ``split_size``) fails the meta check as is, or passes it and fails the
numeric one (HF OPT's ``view(b, -1, num_heads, head_dim)`` folds the heads into the sequence); then
the integer attributes of the group's parent module equal to the full width or the head count are
divided by tp (never one equal to the head dim) and the checks repeated (a block too large for the
numeric check whose shard runs both ways keeps the division only if it changes the shapes and keeps
the sequence dim where the full block has it, and is refused when shapes cannot tell): what passes is recorded in ``TPPlan.local_attrs`` and
applied by the planner's sharded trace and the executor alike.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from autopar.spec.meta import tolerant_meta
from autopar.spec.module_copy import copy_module
from autopar.spec.tp_flow import Flow, trace_flow
from autopar.spec.tp_plan import TPPlan, set_local_attrs

_MAX_CHECK_PARAMS = 8_000_000  # numeric check on CPU below this many block parameters (2 shared cores)
_MAX_CHECK_INPUT = 2_000_000  # ... and this many input elements
_RTOL = 1e-6
MAX_LISTED = 4  # column->row pairs a plan's description names (the rest counted)


@dataclass(frozen=True, kw_only=True)
class Pair:
    cols: tuple[str, ...]
    row: str


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _common_parent(names: tuple[str, ...]) -> str:
    parts = [n.split(".")[:-1] for n in names]
    out: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return ".".join(out)


def pairs_of(flow: Flow) -> tuple[list[Pair], list[str]]:
    """Column->row groups from ``flow`` (row layers in call order, each layer in at most one group)."""
    reached: dict[str, list[str]] = {}
    for row, srcs in flow.row_inputs.items():
        for src in srcs:
            reached.setdefault(src, []).append(row)
    pairs: list[Pair] = []
    notes: list[str] = []
    used: set[str] = set()
    for row in flow.linears:
        srcs = flow.row_inputs.get(row)
        if not srcs:
            continue
        why = next((f"{s} {w}" for s, w in srcs.items() if w is not None), None)
        why = why or next((f"{s} {flow.bad[s]}" for s in srcs if s in flow.bad), None)
        why = why or next((f"{s} feeds {len(reached[s])} layers" for s in srcs if len(reached[s]) > 1), None)
        if why is None and (row in used or used & set(srcs)):
            why = "its layers already belong to another pair"
        if why is not None:
            # A layer after a norm reads the residual stream: not a candidate, and no news.
            if not all(flow.bad.get(s, "").startswith(("is reduced", "is normalised")) for s in srcs):
                notes.append(f"{row}: not a row-parallel layer ({why})")
            continue
        cols = tuple(n for n in flow.linears if n in srcs)
        pairs.append(Pair(cols=cols, row=row))
        used.update(cols + (row,))
    return pairs, notes


def _styles(pairs: list[Pair]) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in pairs:
        out.update({c: "colwise" for c in p.cols})
        out[p.row] = "rowwise"
    return out


def _attr_candidates(block: nn.Module, pair: Pair, flow: Flow) -> list[str]:
    """Integer attributes of the pair's parent module that hold a full width or the head count."""
    parent_name = _common_parent(pair.cols + (pair.row,))
    parent = block.get_submodule(parent_name) if parent_name else block
    width = flow.widths[pair.row][0]
    heads = flow.heads
    head_dim = width // heads if heads else None
    values = {width} | ({heads} if heads else set())
    out = []
    for attr, v in vars(parent).items():
        if attr.startswith("_") or isinstance(v, bool) or not isinstance(v, int):
            continue
        if v in values and v != head_dim:
            out.append(f"{parent_name}.{attr}" if parent_name else attr)
    return out


def _meta_check(block: nn.Module, flow: Flow, styles: dict[str, str], attrs: tuple[str, ...]) -> str | None:
    from autopar.spec.tp_shard import shard_block_for_tp

    sharded = shard_block_for_tp(copy_module(block), styles, 2, attrs)
    try:
        with torch.no_grad(), tolerant_meta():
            sharded(*flow.block_args, **flow.block_kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's block code at tp widths
        return f"the block does not run at tp = 2 ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


class _Shapes(TorchDispatchMode):
    """Records the first output shape of every op, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        first = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
        self.shapes.append(tuple(first.shape) if first is not None else ())
        return out


def _op_shapes(block: nn.Module, flow: Flow, styles: dict[str, str] | None, attrs: tuple[str, ...]) -> list:
    """The op output shapes of one meta run of ``block`` (sharded at tp = 2 unless ``styles`` is None)."""
    from autopar.spec.tp_shard import shard_block_for_tp

    run = copy_module(block) if styles is None else shard_block_for_tp(copy_module(block), styles, 2, attrs)
    rec = _Shapes()
    with torch.no_grad(), tolerant_meta(), rec:
        run(*flow.block_args, **flow.block_kwargs)
    return rec.shapes


def _sequence_folds(full: list, sharded: list, seq: int) -> int | None:
    """How many op outputs of the sharded run changed a dim that holds ``seq`` (the sequence length)
    in the full run at the same place: tensor parallelism never splits the sequence inside a block.
    None when the runs took different op paths (no comparison)."""
    if len(full) != len(sharded):
        return None
    return sum(1 for f, g in zip(full, sharded) if len(f) == len(g)
               for a, b in zip(f, g) if a == seq and b != seq)


def _choose_attrs_by_shapes(block: nn.Module, flow: Flow, styles: dict[str, str],
                            cand: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """For a block too large for the numeric check whose shard runs both with and without ``cand``
    divided: (why not, attrs). The attributes are irrelevant when both runs give the same shapes;
    otherwise the run that keeps the sequence dim (HF OPT's view(b, -1, num_heads, hd) without the
    division folds half the heads into the sequence); neither or both: refused, since only numbers
    could tell."""
    try:
        plain, divided = _op_shapes(block, flow, styles, ()), _op_shapes(block, flow, styles, cand)
        if plain == divided:
            return None, ()
        x = flow.block_args[0] if flow.block_args and isinstance(flow.block_args[0], torch.Tensor) else None
        if x is None or x.dim() < 2:
            return None, ()
        full = _op_shapes(block, flow, None, ())
        a, b = _sequence_folds(full, plain, x.shape[1]), _sequence_folds(full, divided, x.shape[1])
    except Exception:  # noqa: BLE001 - the user's block code; the meta checks above already ran it
        return None, ()
    if a is None or b is None or a == b:
        return (f"dividing {', '.join(cand)} by tp changes the block's shapes, and at this size only a numeric "
                "check could tell which shard is right (declare tp_plan and its local attributes)"), ()
    return (None, cand) if b < a else (None, ())


def _real(value: Any, gen: torch.Generator, dtype: torch.dtype = torch.float64) -> Any:
    def conv(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, generator=gen, dtype=dtype)
        if t.dtype == torch.bool:
            return torch.ones(t.shape, dtype=torch.bool)
        return torch.zeros(t.shape, dtype=t.dtype)

    return tree_map(conv, value)


def _materialise(block: nn.Module, gen: torch.Generator, dtype: torch.dtype = torch.float64) -> nn.Module:
    real = copy_module(block).to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for t in list(real.parameters()) + list(real.buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.2)
            elif t.dtype == torch.bool:
                t.fill_(True)
            else:
                t.zero_()
    return real.eval()  # dropout off; grad mode stays on (keeps torch's fused inference paths out)


def fused_permutation(width: int, k: int, tp: int) -> torch.Tensor:
    """Output order that makes contiguous tp shards hold each rank's slice of all k fused parts
    (Megatron's interleaved QKV; the executor's tensor_parallel._chunk_permutation)."""
    n = width // k
    per = n // tp
    return torch.tensor([c * n + r * per + i for r in range(tp) for c in range(k) for i in range(per)])


def _rank_copy(full: nn.Module, styles: dict[str, str], fused: dict[str, int], attrs: tuple[str, ...],
               rank: int, tp: int) -> nn.Module:
    local = copy_module(full)
    with torch.no_grad():
        for name, style in styles.items():
            mod = local.get_submodule(name)
            conv1d = not isinstance(mod, nn.Linear)  # HF Conv1D: weight (in, out)
            w = mod.weight.t() if conv1d else mod.weight  # (out, in)
            bias = mod.bias
            if style == "colwise":
                k = fused.get(name, 1)
                order = fused_permutation(w.shape[0], k, tp) if k > 1 else torch.arange(w.shape[0])
                rows = order.view(tp, -1)[rank]
                w = w[rows]
                bias = bias[rows] if bias is not None else None
                if conv1d:
                    mod.nf = w.shape[0]
                else:
                    mod.out_features = w.shape[0]
            else:
                w = w.view(w.shape[0], tp, -1)[:, rank]
                bias = bias if bias is None or rank == 0 else torch.zeros_like(bias)  # added once by the sum
                if conv1d:
                    mod.nx = w.shape[1]
                else:
                    mod.in_features = w.shape[1]
            mod.weight = nn.Parameter((w.t() if conv1d else w).contiguous())
            if bias is not None:
                mod.bias = nn.Parameter(bias.contiguous())
    set_local_attrs(local, attrs, tp)
    return local


def _numeric_check(block: nn.Module, flow: Flow, styles: dict[str, str], fused: dict[str, int],
                   attrs: tuple[str, ...]) -> str | None:
    gen = torch.Generator().manual_seed(0)
    full = _materialise(block, gen)
    args, kwargs = _real((flow.block_args, flow.block_kwargs), gen)
    first = lambda v: next((t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)), None)  # noqa: E731
    want = first(full(*args, **kwargs))
    want = want.detach() if want is not None else None
    if want is None or not torch.isfinite(want).all():
        return None  # nothing finite to compare: the meta check stands alone
    tp = 2
    ranks = [_rank_copy(full, styles, fused, attrs, r, tp) for r in range(tp)]
    barrier = threading.Barrier(tp, timeout=120)
    slots: list[Any] = [None] * tp
    results: list[Any] = [None] * tp

    def all_reduce(rank: int) -> Callable:
        def hook(mod: nn.Module, a: tuple, out: torch.Tensor) -> torch.Tensor:
            slots[rank] = out
            barrier.wait()
            total = sum(slots)
            barrier.wait()
            return total
        return hook

    for r, m in enumerate(ranks):
        for name, style in styles.items():
            if style == "rowwise":
                m.get_submodule(name).register_forward_hook(all_reduce(r))

    def work(r: int) -> None:
        try:
            results[r] = first(ranks[r](*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - reported below
            results[r] = exc
            barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if all(isinstance(r, threading.BrokenBarrierError) for r in results):
        return "the simulated tp = 2 block did not finish (its ranks called their row layers differently)"
    for r in results:
        if isinstance(r, threading.BrokenBarrierError):
            continue  # the other rank's error is the news
        if isinstance(r, Exception):
            return f"the simulated tp = 2 block failed ({type(r).__name__}: {str(r).splitlines()[0] if str(r) else ''})"
        scale = float(want.detach().abs().max()) or 1.0
        err = float((r.detach() - want.detach()).abs().max()) / scale
        if err > _RTOL:
            return f"the simulated tp = 2 block differs from the full block (relative error {err:.1e})"
    return None


def _small(block: nn.Module, flow: Flow) -> bool:
    n_params = sum(p.numel() for p in block.parameters())
    n_in = sum(t.numel() for t in tree_flatten((flow.block_args, flow.block_kwargs))[0] if isinstance(t, torch.Tensor))
    return n_params <= _MAX_CHECK_PARAMS and n_in <= _MAX_CHECK_INPUT


def check_pairs(block: nn.Module, flow: Flow, pairs: list[Pair]) -> tuple[list[Pair], tuple[str, ...], list[str], bool]:
    """Keep the pairs whose sharded block runs (and, when small, matches numerically).
    Returns (kept pairs, local attributes, notes, numerically checked)."""
    kept: list[Pair] = []
    attrs: list[str] = []
    notes: list[str] = []
    numeric = _small(block, flow)
    for pair in pairs:
        styles = _styles([pair])
        fused = {c: flow.fused[c] for c in pair.cols if flow.fused.get(c, 1) > 1}
        extra: tuple[str, ...] = ()
        why = _meta_check(block, flow, styles, ())
        if why is not None:
            cand = tuple(_attr_candidates(block, pair, flow))
            if cand and _meta_check(block, flow, styles, cand) is None:
                why, extra = None, cand
        elif not numeric:
            cand = tuple(_attr_candidates(block, pair, flow))
            if cand and _meta_check(block, flow, styles, cand) is None:
                why, extra = _choose_attrs_by_shapes(block, flow, styles, cand)
        if why is None and numeric:
            why = _numeric_check(block, flow, styles, fused, extra)
            if why is not None and not extra:
                # Shapes can pass and numbers fail: OPT views its projection as (b, -1, num_heads, hd),
                # so a tp shard folds half the heads into the sequence. Divide the attributes and retry.
                cand = tuple(_attr_candidates(block, pair, flow))
                if (cand and _meta_check(block, flow, styles, cand) is None
                        and _numeric_check(block, flow, styles, fused, cand) is None):
                    why, extra = None, cand
        if why is not None:
            if flow.heads and flow.heads % 2:
                why += f" (tp = 2 does not divide its {flow.heads} heads)"
            notes.append(f"{' + '.join(pair.cols)} -> {pair.row}: {why}")
            continue
        kept.append(pair)
        attrs.extend(a for a in extra if a not in attrs)
    if len(kept) > 1:
        why = _meta_check(block, flow, _styles(kept), tuple(attrs))
        if why is not None:
            notes.append(f"the pairs together: {why}")
            return [], (), notes, numeric
    return kept, tuple(attrs), notes, numeric


@dataclass(frozen=True, kw_only=True)
class Inference:
    plan: TPPlan
    heads: int | None
    kv_heads: int | None


def infer_tp(model: nn.Module, block: nn.Module, run: Callable[[], Any]) -> Inference:
    """The inferred TP plan of ``block`` (block 0 of ``model``; ``run()`` is one meta forward).
    Never raises: inference is an offer, and a model it cannot read plans without TP, saying why."""
    try:
        return _infer(model, block, run)
    except Exception as exc:  # noqa: BLE001 - the user's code under a dispatch mode, on meta and CPU
        why = f"the data flow of block 0 could not be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return Inference(plan=TPPlan(styles={}, source="none", detail=why), heads=None, kv_heads=None)


def _infer(model: nn.Module, block: nn.Module, run: Callable[[], Any]) -> Inference:
    flow = trace_flow(model, block, run)
    pairs, notes = pairs_of(flow)
    notes = flow.skipped + notes
    kept, attrs, check_notes, numeric = check_pairs(block, flow, pairs) if pairs else ([], (), [], False)
    notes += check_notes
    heads, kv = flow.heads, flow.kv_heads
    if not kept:
        why = "the data flow of block 0 shows no column->row pair" if not pairs else "no column->row pair passed the check"
        return Inference(plan=TPPlan(styles={}, source="none", detail=why, dropped=tuple(notes)), heads=heads, kv_heads=kv)
    how = "checked on CPU at tp = 2" if numeric else "shapes checked at tp = 2"
    pairs_text = [f"{'+'.join(p.cols)} -> {p.row}" for p in kept]
    # a unit of many layers (Hiera's third stage: 72 pairs) is named by its first pairs, not all
    listed = "; ".join(pairs_text if len(pairs_text) <= MAX_LISTED else
                       [*pairs_text[:MAX_LISTED - 1], f"... {len(pairs_text) - MAX_LISTED + 1} more"])
    fused = {c: flow.fused[c] for p in kept for c in p.cols if flow.fused.get(c, 1) > 1}
    plan = TPPlan(styles=_styles(kept), source="inferred",
                  detail=f"data flow of block 0: {len(kept)} column->row pair{'s' if len(kept) > 1 else ''} "
                         f"({listed}; {how})",
                  dropped=tuple(notes), fused=fused, local_attrs=attrs)
    return Inference(plan=plan, heads=heads, kv_heads=kv)
