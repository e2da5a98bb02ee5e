"""Where each Linear layer's output features go inside one block (the data flow TP inference reads).

``trace_flow`` runs block 0 once on meta under a dispatch mode that follows, for every Linear (or HF
``Conv1D``) of the block, how its output feature axis travels through the ops until it enters another
Linear. Column->row tensor parallelism of a pair (A colwise, B rowwise) is exact when every rank can
compute its contiguous slice of A's features alone up to B: no op may reduce over, index into, or
re-order the *sharded* part of that axis before B contracts it.

The axis is tracked as a list of *pieces*, most significant first: ``(dim, stride, extent)`` says that
along tensor dim ``dim`` (negative, so broadcasting keeps it) the index ``i`` carries the feature
coordinate ``(i // stride) % extent``. A Linear's output starts as one piece ``(-1, 1, N)``; a view
that splits N into (heads, head_dim) splits it into two pieces, a transpose moves them, a merge back
joins them. The first piece is the one a tp shard cuts (contiguous chunks of the most significant
coordinate): a reduction, softmax, index or position mask over its dim marks the source *bad*;
work on the other pieces (contracting head_dim in q @ k^T, rotating within a head) is local to a rank.
Selecting whole chunks of the first piece (``qkv.unbind``, ``split(hidden)``) marks a *fused*
projection of that many parts. A source reaches a row layer validly when its first piece is the
input's feature dim and spans it from the top. Heads and KV heads are read off the first attention
matmul: the extents of q's and k's first pieces on its batch (heads) dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from autopar.spec.meta import tolerant_meta
from autopar.spec.tp_plan import is_tp_linear

Piece = tuple[int, int, int]  # (negative dim, stride, extent)
Taint = dict[str, tuple[Piece, ...]]
_POISON: tuple[Piece, ...] = ((-1, 1, 1),)  # a bad source's mark once its layout is lost

_IDENTITY = {"_to_copy", "clone", "contiguous", "alias", "detach", "lift_fresh", "native_dropout", "dropout",
             "expand", "repeat", "copy_", "to", "type_as", "_conj", "resolve_conj", "resolve_neg"}
_RESHAPE = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "view_as"}
_SHAPE_ONLY = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "new_zeros",
               "new_ones", "new_empty", "new_full", "empty_strided", "_assert_tensor_metadata"}
_REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "norm",
           "linalg_vector_norm", "prod", "logsumexp", "argmax", "argmin", "any", "all"}
_SOFTMAX = {"_softmax", "_safe_softmax", "_log_softmax", "softmax", "log_softmax", "cumsum", "cumprod"}
_POSITIONAL = {"tril", "triu", "roll", "flip", "constant_pad_nd", "pad"}
_SDPA = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
         "scaled_dot_product_attention", "_scaled_dot_product_attention_math"}


@dataclass(kw_only=True)
class Flow:
    """What ``trace_flow`` saw in block 0 (block-relative Linear names, in call order)."""

    linears: list[str] = field(default_factory=list)
    widths: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (in, out) features
    row_inputs: dict[str, dict[str, str | None]] = field(default_factory=dict)  # row -> src -> None | why not
    bad: dict[str, str] = field(default_factory=dict)  # source -> why its features cannot be sharded
    fused: dict[str, int] = field(default_factory=dict)  # source -> projections it stacks
    heads: int | None = None
    kv_heads: int | None = None
    block_args: tuple = ()
    block_kwargs: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # notes (e.g. attention without Linear layers)


def _pos(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _coalesce(pieces: tuple[Piece, ...]) -> tuple[Piece, ...]:
    out: list[Piece] = []
    for p in pieces:
        if out and out[-1][0] == p[0] and out[-1][1] == p[1] * p[2]:
            out[-1] = (p[0], p[1], out[-1][2] * p[2])
        else:
            out.append(p)
    return tuple(out)


def _view_groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of dims of shape ``a`` and ``b`` with equal products (size-1 dims ride along)."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(a):
            gi.append(i); pa *= a[i]; i += 1  # noqa: E702
        if j < len(b):
            gj.append(j); pb *= b[j]; j += 1  # noqa: E702
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i); pa *= a[i]; i += 1  # noqa: E702
            elif pb < pa and j < len(b):
                gj.append(j); pb *= b[j]; j += 1  # noqa: E702
            else:
                return None
        groups.append((gi, gj))
    return groups


class _Tracker(TorchDispatchMode):
    def __init__(self, flow: Flow) -> None:
        super().__init__()
        self.flow = flow
        self.taint: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.active = False
        self.depth = 0  # > 0 inside a tracked Linear: its own ops are the contraction, not data flow

    # -- bookkeeping -------------------------------------------------------------------------
    def bad(self, src: str, why: str) -> None:
        self.flow.bad.setdefault(src, why)

    def get(self, t: Any) -> Taint:
        return self.taint.get(t, {}) if isinstance(t, torch.Tensor) else {}

    def put(self, t: Any, taint: Taint) -> None:
        if isinstance(t, torch.Tensor) and taint:
            self.taint[t] = dict(taint)

    def merge(self, parts: list[Taint]) -> Taint:
        out: Taint = {}
        for taint in parts:
            for src, pieces in taint.items():
                if src in out and out[src][:1] != pieces[:1]:
                    self.bad(src, "meets itself in two different layouts")
                out.setdefault(src, pieces)
        return out

    def remap(self, taint: Taint, ndim_in: int, ndim_out: int, dim_map: Callable[[int], int | None],
              reduced: set[int] = frozenset(), why: str = "") -> Taint:
        """Move pieces by ``dim_map`` (positive in -> positive out or None: dropped); a first piece
        on a dim in ``reduced`` (or dropped) makes its source bad with ``why``."""
        out: Taint = {}
        for src, pieces in taint.items():
            new: list[Piece] = []
            for k, (d, s, e) in enumerate(pieces):
                pd = _pos(d, ndim_in)
                nd = None if pd in reduced else dim_map(pd)
                if nd is None:
                    if k == 0:
                        self.bad(src, why)
                        break
                    continue
                new.append((nd - ndim_out, s, e))
            else:
                if new:
                    out[src] = tuple(new)
        return out

    # -- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active or self.depth:
            return out
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and self.get(t)]
        if not flat_in:
            return out
        name = func._overloadpacket.__name__
        srcs = {src for t in flat_in for src in self.get(t)}
        try:
            self.propagate(func, name, args, kwargs, out)
        except Exception as exc:  # noqa: BLE001 - an op this tracker misreads must not break the probe
            for src in srcs:
                self.bad(src, f"reaches {name}, which the data flow could not follow ({type(exc).__name__})")
        # A bad source stays on what it touched, so that every layer it reaches sees it (and is
        # refused as a row layer), even where its layout is lost.
        poisoned = [s for s in srcs if s in self.flow.bad]
        if poisoned and name not in _SHAPE_ONLY:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    taint = dict(self.get(o))
                    for src in poisoned:
                        taint.setdefault(src, _POISON)
                    self.put(o, taint)
        return out

    def propagate(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        x = args[0] if args else None
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name in _SHAPE_ONLY:
            return
        if torch.Tag.pointwise in func.tags or name in _IDENTITY:
            merged = self.merge([self.get(t) for t in tree_flatten((args, kwargs))[0]])
            for o in outs:
                self.put(o, merged)
            return
        if name in _RESHAPE:
            self.put(out, self.reshape(self.get(x), list(x.shape), list(out.shape)))
            return
        if name in ("transpose", "t", "permute", "movedim", "swapaxes"):
            nd = x.dim()
            if name == "permute":
                order = [_pos(d, nd) for d in args[1]]
            else:
                d0, d1 = (0, 1) if name == "t" else (_pos(args[1], nd), _pos(args[2], nd))
                order = list(range(nd))
                order[d0], order[d1] = order[d1], order[d0]
            inv = {src: k for k, src in enumerate(order)}
            self.put(out, self.remap(self.get(x), nd, nd, inv.get))
            return
        if name == "view_as_complex":  # (..., n, 2) real pairs -> (..., n) complex: complex RoPE (torchtitan)
            nd = x.dim()
            self.put(out, self.remap(self.get(x), nd, nd - 1, lambda d: d if d < nd - 1 else None,
                                     why="is paired into complex numbers across its sharded feature dim"))
            return
        if name == "view_as_real":  # (..., n) complex -> (..., n, 2): the pair dim carries no piece
            self.put(out, self.remap(self.get(x), x.dim(), x.dim() + 1, lambda d: d))
            return
        if name in ("select", "unbind"):
            dim = _pos(args[1] if len(args) > 1 else kwargs.get("dim", 0), x.dim())
            for o in outs:
                self.put(o, self.take(self.get(x), x, dim, None, drop_dim=True, name=name))
            return
        if name in ("slice", "split", "split_with_sizes", "unsafe_split", "chunk", "narrow"):
            at = 1 if name in ("slice", "narrow") else 2  # split(self, size, dim), slice(self, dim, ...)
            dim = _pos(args[at] if len(args) > at else kwargs.get("dim", 0), x.dim())
            start = 0
            for o in outs:
                if name == "slice":
                    start = args[2] if len(args) > 2 and args[2] is not None else 0
                    start = start + x.shape[dim] if start < 0 else start
                length = o.shape[dim]
                aligned = length == 0 or start % length == 0  # a fused part starts on a part boundary
                self.put(o, self.take(self.get(x), x, dim, length if aligned else -1, drop_dim=False, name=name))
                start += length
            return
        if name == "stack":
            tensors = list(args[0])
            nd = tensors[0].dim()
            dim = _pos(args[1] if len(args) > 1 else kwargs.get("dim", 0), nd + 1)
            self.put(out, self.merge([self.remap(self.get(t), nd, nd + 1, lambda d: d if d < dim else d + 1)
                                      for t in tensors]))
            return
        if name in ("cat", "concat"):
            tensors = [t for t in args[0] if t.dim() > 0]
            dim = _pos(args[1] if len(args) > 1 else kwargs.get("dim", 0), tensors[0].dim())
            nd = tensors[0].dim()
            parts = [self.remap(self.get(t), nd, nd, lambda d: d if d != dim else None, why="is concatenated along "
                                "its sharded feature dim") for t in tensors]
            self.put(out, self.merge(parts))
            return
        if name in ("bmm", "mm", "baddbmm", "addmm", "matmul"):
            a, b = (args[1], args[2]) if name in ("baddbmm", "addmm") else (args[0], args[1])
            self.matmul(a, b, out, extra=self.get(args[0]) if name in ("baddbmm", "addmm") else {})
            return
        if name in _SDPA:
            self.sdpa(args[0], args[1], args[2], outs[0])
            return
        if name in _SOFTMAX:
            dim = _pos(args[1], x.dim())
            self.put(out, self.remap(self.get(x), x.dim(), x.dim(), lambda d: d, reduced={dim},
                                     why=f"is normalised by {name} over its sharded feature dim"))
            return
        if name in _REDUCE:
            dims = args[1] if len(args) > 1 else kwargs.get("dim")
            nd = x.dim()
            red = set(range(nd)) if dims is None or dims == [] else {_pos(d, nd) for d in ([dims] if isinstance(dims, int) else dims)}
            keep = [d for d in range(nd) if d not in red]
            for o in outs:
                dmap = (lambda d: d) if o.dim() == nd else (lambda d: keep.index(d) if d in keep else None)
                self.put(o, self.remap(self.get(x), nd, o.dim(), dmap, reduced=red,
                                       why=f"is reduced by {name} over its sharded feature dim"))
            return
        if name in ("native_layer_norm", "_fused_rms_norm", "rms_norm", "layer_norm"):
            nd = x.dim()
            red = set(range(nd - len(args[1]), nd))
            self.put(outs[0], self.remap(self.get(x), nd, nd, lambda d: d, reduced=red,
                                         why=f"is normalised by {name} over its sharded feature dim"))
            return
        if name in _POSITIONAL:
            nd = x.dim()
            red = {nd - 2, nd - 1} if name in ("tril", "triu") else set(range(nd))
            self.put(out, self.remap(self.get(x), nd, out.dim(), lambda d: d, reduced=red,
                                     why=f"is indexed by position ({name}) along its sharded feature dim"))
            return
        for t in tree_flatten((args, kwargs))[0]:
            for src in self.get(t):
                self.bad(src, f"reaches {name}, which autopar's data flow does not follow")

    # -- op rules ----------------------------------------------------------------------------
    def reshape(self, taint: Taint, a: list[int], b: list[int]) -> Taint:
        groups = _view_groups(a, b)
        out: Taint = {}
        for src, pieces in taint.items():
            if groups is None:
                self.bad(src, f"is reshaped unevenly ({a} -> {b})")
                continue
            new: list[Piece] = []
            for d, s, e in pieces:
                pd = _pos(d, len(a))
                gi, gj = next((gi, gj) for gi, gj in groups if pd in gi)
                inner_in = 1
                for k in gi[gi.index(pd) + 1:]:
                    inner_in *= a[k]
                lo_flat, hi_flat = s * inner_in, s * e * inner_in  # multiplicative range in the group
                stride_out = 1
                sub: list[Piece] = []
                for j in reversed(gj):
                    lo, hi = max(lo_flat, stride_out), min(hi_flat, stride_out * b[j])
                    if lo < hi and b[j] > 1:
                        if lo % stride_out or hi % lo:
                            self.bad(src, f"is reshaped across its feature boundaries ({a} -> {b})")
                        sub.append((j - len(b), lo // stride_out, hi // lo))
                    stride_out *= b[j]
                new.extend(reversed(sub))
            if new:
                out[src] = _coalesce(tuple(new))
        return out

    def take(self, taint: Taint, x: torch.Tensor, dim: int, length: int | None, *, drop_dim: bool, name: str) -> Taint:
        """select/unbind (``length`` None) or a slice of ``length`` along ``dim``."""
        nd, size = x.dim(), x.shape[dim]
        out: Taint = {}
        for src, pieces in taint.items():
            new: list[Piece] = []
            for k, (d, s, e) in enumerate(pieces):
                pd = _pos(d, nd)
                if pd != dim:
                    new.append((d + 1 if drop_dim and pd < dim else d, s, e))  # a dim to its right went away
                    continue
                if length == size:
                    new.append((d, s, e))
                elif drop_dim and k > 0:
                    pass  # a select inside an inner piece: local to a rank's shard
                elif k == 0:
                    whole = s == 1 and e == size
                    parts = size if length is None else size // length if length > 0 and size % length == 0 else 0
                    if not whole or not parts:
                        self.bad(src, f"is indexed ({name}) inside its sharded feature dim")
                        break
                    if self.flow.fused.setdefault(src, parts) != parts:
                        self.bad(src, "is split into fused parts twice")
                    if length is not None:
                        new.append((d, 1, length))
                # an inner piece indexed: local to a rank's shard, it just goes away
            else:
                if new:
                    out[src] = tuple(new)
        return out

    def matmul(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, extra: Taint) -> None:
        na, nb, no = a.dim(), b.dim(), out.dim()
        why = "is contracted by a matmul over its sharded feature dim"
        # a: (..., n, m) -> out (..., n, p); b: (..., m, p); batch dims right-aligned.
        ta = self.remap(self.get(a), na, no, lambda d: None if d == na - 1 else d + (no - na), reduced={na - 1}, why=why)
        tb = self.remap(self.get(b), nb, no, lambda d: None if d == nb - 2 else d + (no - nb), reduced={nb - 2}, why=why)
        if no >= 3 and self.flow.heads is None:
            qa = [p[0][2] for p in ta.values() if _pos(p[0][0], no) < no - 2]
            kb = [p[0][2] for p in tb.values() if _pos(p[0][0], no) < no - 2]
            if qa:
                self.flow.heads, self.flow.kv_heads = max(qa), max(kb) if kb else max(qa)
        self.put(out, self.merge([ta, tb, extra]))

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        for t in (q, k, v):
            for src, pieces in self.get(t).items():
                if _pos(pieces[0][0], t.dim()) != t.dim() - 3:
                    self.bad(src, "enters attention with its shard outside the heads dim")
        if self.flow.heads is None and self.get(q):
            self.flow.heads = max(p[0][2] for p in self.get(q).values())
            kv = [p[0][2] for p in self.get(k).values()]
            self.flow.kv_heads = max(kv) if kv else self.flow.heads
        nd = q.dim()
        tq = self.remap(self.get(q), nd, nd, lambda d: d if d < nd - 1 else None)
        self.put(out, self.merge([tq, self.get(v)]))


def trace_flow(model: nn.Module, block: nn.Module, run: Callable[[], Any]) -> Flow:
    """Run ``run()`` (one meta forward of ``model``) and follow the data flow of ``block``."""
    flow = Flow()
    tracker = _Tracker(flow)
    handles = []
    names = {id(m): n for n, m in block.named_modules() if n and is_tp_linear(m)}
    for name, mod in block.named_modules():
        if id(mod) not in names or names[id(mod)] != name:
            continue

        def pre(m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            if tracker.active and not tracker.depth:
                x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
                taint = tracker.get(x)
                if name not in flow.linears:
                    flow.linears.append(name)
                w = m.weight.shape
                flow.widths[name] = (w[1], w[0]) if isinstance(m, nn.Linear) else (w[0], w[1])
                seen = flow.row_inputs.setdefault(name, {}) if taint else {}
                for src, pieces in taint.items():
                    p = _coalesce(pieces)[0]
                    ok = _pos(p[0], x.dim()) == x.dim() - 1 and p[1] * p[2] == x.shape[-1]
                    seen[src] = None if ok else "reaches it with its shard not on the input's feature dim"
            tracker.depth += 1

        def post(m: nn.Module, args: tuple, out: Any, name: str = name) -> None:
            tracker.depth -= 1
            if tracker.active and not tracker.depth and isinstance(out, torch.Tensor):
                tracker.put(out, {name: ((-1, 1, out.shape[-1]),)})

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    for name, mod in block.named_modules():
        if isinstance(mod, nn.MultiheadAttention):
            flow.skipped.append(
                f"{name}: nn.MultiheadAttention projects q, k, v from one fused parameter (in_proj_weight) and "
                "applies out_proj functionally, so it has no Linear layers to shard; kept replicated")

    def on_block(m: nn.Module, args: tuple, kwargs: dict) -> None:
        if not flow.block_args and not flow.block_kwargs:
            flow.block_args, flow.block_kwargs = args, dict(kwargs)
            tracker.active = True

    def off_block(m: nn.Module, args: tuple, out: Any) -> None:
        if tracker.active:
            for t in tree_flatten(out)[0]:
                for src in tracker.get(t):
                    tracker.bad(src, "reaches the block's output unreduced")
        tracker.active = False

    handles.append(block.register_forward_pre_hook(on_block, with_kwargs=True))
    handles.append(block.register_forward_hook(off_block))
    try:
        with torch.no_grad(), tolerant_meta(), tracker:
            run()
    finally:
        for h in handles:
            h.remove()
    return flow
