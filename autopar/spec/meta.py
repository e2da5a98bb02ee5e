"""Running a user's forward on the meta device, where data-dependent code has no data.

Real model code asks its tensors for values now and then: Hugging Face's packed-sequence check calls
``.item()``, masks test ``bool(tensor)``, a mixture of experts asks which tokens chose each expert
(``torch.where(idx == e)``, ``nonzero``). Meta tensors hold no values, so those calls raise.
``tolerant_meta()`` answers them instead, with the value of the common training path, so that a
forward runs through and its shapes, FLOPs and saved tensors can be measured:

* value reads (``.item()``, ``bool(t)``, ``torch.equal``, and copies of integer and boolean tensors
  to a real device: ``.cpu()``, ``.tolist()``; activations copied out still fail): 0 / False -- no
  packed sequences, no padding detected -- except the result of ``all()``, which is True (Hugging
  Face asks ``(packed_sequence_mask[:, -1] == 0).all()``: "is nothing packed?"; a plain batch says
  yes, and its attention then runs causal, without a mask), and so is ``torch._check_tensor_all``'s
  (``_is_all_true``: a model's own assertion, LLaVA's "as many image tokens as image features",
  holds on the path it trains), and a count made
  from a routing tensor (below: ``mask.sum()``, ``bincount(idx)``), which is the expected count
  per expert, or True (``mask.any()``: an expert has tokens).
* data-dependent shapes (``nonzero``, one-argument ``torch.where``, ``argwhere``,
  ``masked_select``, ``unique``, indexing with a boolean mask): every element taken as nonzero and distinct (no padding), except
  for tensors of a top-k routing (below); ``bincount`` and ``repeat_interleave`` answer routing
  counts only (``bincount(x, minlength=n)`` has length n).
* ``torch._grouped_mm`` in a dtype its meta kernel refuses (it takes bf16 only): the output's
  shape and dtype, as a GPU kernel of that dtype would give.

Routing. A ``topk`` over the last dimension of a (tokens, experts) score tensor is a router (so is
a top-1 ``argmax`` / ``max`` over at most 1024 scores, Switch-style, while no top-k is known): its
indices, and the integer or boolean tensors computed from them, are routing tensors. Routing is
taken as balanced, the expected load of a trained router with a balancing loss: each of the E
experts receives tokens x top_k / E (token, slot) pairs. So a routing mask with tokens or
tokens x top_k elements (``idx == e``, ``(idx == e).any(-1)``, a slice of ``one_hot(idx)``, a
constant scattered at the indices, ``zeros.scatter(1, idx, 1)``, even in a float tensor) has
tokens x top_k / E nonzeros, and one with E (or E + 1, a sentinel class) elements ("which experts
were hit") has E. Every op still runs as PyTorch dispatches it; only value reads and these
data-dependent shapes are answered.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from autopar.spec.meta_fallback import run_for_shapes
from autopar.spec.meta_memo import flat_tensors, lookup, memo_key, remember
from autopar.spec.meta_values import KnownValues, meta_format

_SCATTER_VALUE = {torch.ops.aten.scatter.value, torch.ops.aten.scatter_.value}
_VALUE_READS = {"_local_scalar_dense", "is_nonzero", "equal"}
_MASK_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"}
_DATA_SHAPED = {"nonzero", "masked_select", "bincount", "_unique2", "repeat_interleave"}
# Ops whose result, made from a routing tensor, answers "how many tokens / any token?" per expert.
_COUNTS = {"any", "sum", "count_nonzero", "max", "amax", "bincount"}
# Ops that pass their input's values on (views, copies, picks): the result keeps the input's label.
_PASS_ON = {"select", "slice", "view", "_unsafe_view", "reshape", "unbind", "index", "clone", "_to_copy", "squeeze",
            "unsqueeze", "alias", "detach", "lift_fresh", "expand", "permute", "t", "transpose", "contiguous",
            "flatten", "split", "chunk", "narrow", "copy_"}


@dataclass(frozen=True, kw_only=True)
class Routing:
    """The top-k routing seen last in this forward: (token, slot) pairs are tokens x top_k."""

    tokens: int
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        if not (self.tokens >= 0 and 1 <= self.top_k < self.num_experts):
            raise ValueError(f"not a top-k routing: {self}")

    @property
    def per_expert(self) -> int:
        """(token, slot) pairs each expert receives under balanced routing (at least 1 when any)."""
        pairs = self.tokens * self.top_k
        return max(1, round(pairs / self.num_experts)) if pairs else 0

    def nonzeros(self, numel: int) -> int | None:
        """Nonzeros of a routing mask of ``numel`` elements, None when its shape says nothing."""
        if numel in (self.num_experts, self.num_experts + 1):
            return self.num_experts
        if numel in (self.tokens, self.tokens * self.top_k):
            return self.per_expert
        return None


def grouped_mm_meta(args: tuple, kwargs: dict) -> torch.Tensor:
    """The output of ``torch._grouped_mm(a, b, offs, bias, out_dtype)`` on meta, any dtype
    (layouts in autopar.graph.trace._grouped_mm_cost)."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    groups = int(offs.shape[0]) if isinstance(offs, torch.Tensor) else 1
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[2])
    elif a.dim() == 3 and b.dim() == 2:
        shape = (a.shape[1], b.shape[1])
    elif a.dim() == 2 and b.dim() == 2:
        shape = (groups, a.shape[0], b.shape[1])
    else:
        shape = (a.shape[0], a.shape[1], b.shape[2])
    return torch.empty(shape, dtype=out_dtype or a.dtype, device="meta")


def call_on_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` from inside a dispatch mode, or, where a meta kernel refuses a dtype
    the device kernel takes (torch's ``_grouped_mm`` meta kernel refuses fp32, its CPU kernel runs
    it), what it would have returned; an op with no meta kernel at all answers with the shapes its CPU
    kernel gives on zero stand-ins (spec/meta_fallback.py); any other error stands. Every dispatch mode that runs the
    user's forward or backward on meta calls ops through this (the first mode to see an op is the
    one whose call raises). Answered from a memo where the same op saw the same input metadata
    before (spec/meta_memo.py)."""
    key = memo_key(func, args, kwargs)
    if key is not None:
        out = lookup(key)
        if out is not None:
            return out
    try:
        out = func(*args, **kwargs)
    except NotImplementedError:  # no meta kernel at all (the CTC loss): shapes from the CPU kernel
        out = run_for_shapes(func, args, kwargs)
        if out is None:
            raise
        return out
    except RuntimeError:
        if func._overloadpacket.__name__ == "_grouped_mm" and all(
                isinstance(a, torch.Tensor) and a.is_meta for a in args[:2]):
            return grouped_mm_meta(args, kwargs)
        raise
    if key is not None:
        remember(key, args, kwargs, out)
    return out


def _is_meta(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_meta for a in args)


class OpBudgetExceeded(BaseException):
    """Raised inside a forward under ``tolerant_meta`` that dispatched more aten ops than an armed
    ``op_budget`` allows (a BaseException: the user's ``except Exception`` does not swallow it)."""


@dataclass(kw_only=True)
class OpBudget:
    """At most ``limit`` aten ops per forward under ``tolerant_meta``; ``tripped``: some forward
    went past it (set even where what was raised got caught or wrapped on its way out); ``most``:
    the most ops one forward dispatched."""

    limit: int
    tripped: bool = False
    most: int = 0


_BUDGETS: list[OpBudget] = []  # armed budgets, innermost last


@contextmanager
def op_budget(limit: int) -> Iterator[OpBudget]:
    """Within the block, a forward under ``tolerant_meta`` that dispatches more than ``limit`` aten
    ops raises ``OpBudgetExceeded`` (graph/short_probe.py: a forward whose op count grows with the
    sequence, a per-position Python loop, is measured at a shorter sequence instead)."""
    budget = OpBudget(limit=limit)
    _BUDGETS.append(budget)
    try:
        yield budget
    finally:
        _BUDGETS.remove(budget)


class _TolerantMeta(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0  # aten ops dispatched (op_budget)
        self.routing: Routing | None = None
        self.routed: dict[int, str] = {}  # id of a routing tensor -> the op that made it
        self.alive: list[torch.Tensor] = []  # keeps routing tensors alive so their ids stay theirs
        self.alls: set[int] = set()  # ids of all() results (kept alive in ``alive``): they read True
        self.known = KnownValues()  # the experts a balanced routing hits, and picks of them (meta_values.py)
        # top-1 picks not yet read (``_note_top1``): id of the indices -> the routing they would be
        self.tentative: dict[int, Routing] = {}
        # float tensors computed from a parameter, held weakly: a strong reference would keep every
        # activation alive and the live-memory trace (graph/live.py) would count them all
        self.learned: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def _is_routed(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.routed

    def _mark(self, out: Any, name: str, inputs: list[Any] = (), *, floats: bool = False) -> None:
        label = name
        source = next((self.routed[id(a)] for a in inputs if self._is_routed(a)), None)
        if name in _PASS_ON and source is not None:
            label = source
        elif name in ("max", "amax") and source == "topk":
            label = "largest expert"  # idx.max(): the largest expert id, not a count
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (floats or not t.is_floating_point()) and not t.is_complex():
                self.routed[id(t)] = label
                self.alive.append(t)

    def _counts(self, t: Any) -> bool:
        return self.routing is not None and self.routed.get(id(t)) in _COUNTS

    def _value(self, name: str, args: tuple) -> Any:
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "equal":
            return False
        known = self.known.get(t)
        if known is not None and known.numel() == 1:
            return bool(known) if name == "is_nonzero" else known.item()
        if t is not None and self.routing is not None and self.routed.get(id(t)) == "largest expert":
            return self.routing.num_experts - 1
        if t is not None and self._counts(t):
            if t.dtype == torch.bool or name == "is_nonzero":
                return True  # "does this expert have tokens?": under balanced routing, yes
            return self.routing.per_expert  # "how many tokens did it get?"
        if t is not None and id(t) in self.alls:
            return True
        if name == "is_nonzero" or (t is not None and t.dtype == torch.bool):
            return False
        return 0.0 if t is not None and t.is_floating_point() else 0

    def _data_shaped(self, name: str, args: tuple, kwargs: dict) -> torch.Tensor:
        x = args[0]
        routed = self.routing is not None and self._is_routed(x)
        if name == "bincount":
            minlength = int(args[2] if len(args) > 2 else kwargs.get("minlength", 0))
            if routed:
                length = max(minlength, self.routing.num_experts)
            elif minlength > 0:
                length = minlength
            else:
                raise NotImplementedError("bincount on meta needs minlength= (its length is the largest value + 1)")
            w = args[1] if len(args) > 1 else kwargs.get("weights")
            dtype = w.dtype if isinstance(w, torch.Tensor) else torch.int64
            return torch.empty((length,), dtype=dtype, device="meta")
        if name == "_unique2":  # torch.unique: routing indices hold every expert, other values are distinct
            n = self.routing.num_experts if routed else x.numel()
            inverse = args[2] if len(args) > 2 else kwargs.get("return_inverse", False)
            counts = args[3] if len(args) > 3 else kwargs.get("return_counts", False)
            values = torch.empty((n,), dtype=x.dtype, device="meta")
            inv = torch.empty(x.shape if inverse else (0,), dtype=torch.int64, device="meta")
            cnt = torch.empty((n,) if counts else (0,), dtype=torch.int64, device="meta")
            if routed:
                self._mark((values, inv), "unique")
                self._mark(cnt, "bincount")  # per-value counts: a routing count
            return values, inv, cnt
        if name == "repeat_interleave":  # only repeat_interleave(counts) of routing counts: sum = E x per expert
            return torch.empty((x.numel() * self.routing.per_expert,), dtype=torch.int64, device="meta")
        if name == "masked_select":
            mask = args[1]
            numel = torch.broadcast_shapes(x.shape, mask.shape).numel()
            rows = self.routing.nonzeros(numel) if self.routing is not None and self._is_routed(mask) else None
            return torch.empty((numel if rows is None else rows,), dtype=x.dtype, device="meta")
        rows = self.routing.nonzeros(x.numel()) if routed else None
        return torch.empty((x.numel() if rows is None else rows, x.dim()), dtype=torch.int64, device="meta")

    def _long_indices(self, indices: list) -> list:
        """Boolean (mask) indices replaced by the long indices of their nonzeros, as answered above
        (``x[mask]``, ``x[mask] = v``: PyTorch's meta kernels would call nonzero themselves)."""
        out: list = []
        for t in indices:
            if isinstance(t, torch.Tensor) and t.is_meta and t.dtype in (torch.bool, torch.uint8):
                nz = self._data_shaped("nonzero", (t,), {})
                if self._is_routed(t):
                    self._mark(nz, "nonzero")
                cols = nz.unbind(1)
                if self._is_routed(t):
                    self._mark(cols, "nonzero")
                out.extend(cols)
            else:
                out.append(t)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if _BUDGETS:
            self._count()
        if self.tentative:
            self._confirm_top1(args, kwargs)
        name = func._overloadpacket.__name__
        if name in _MASK_INDEXED and len(args) > 1 and _is_meta(args[:1]) and any(
                isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in args[1]):
            args = (args[0], self._long_indices(list(args[1])), *args[2:])
        if name in _VALUE_READS and _is_meta(args):
            return self._value(name, args)
        if name in _DATA_SHAPED and _is_meta(args) and (name != "repeat_interleave" or (
                func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
                and self._counts(args[0]))):
            out = self._data_shaped(name, args, kwargs)
        elif (name == "_to_copy" and _is_meta(args[:1]) and kwargs.get("device") not in (None, torch.device("meta"))
              and not args[0].is_floating_point() and not args[0].is_complex()):
            out = self._copy_out(args[0], kwargs)  # .cpu(), .tolist() of counts and masks: what reads get
        else:
            out = call_on_meta(func, args, kwargs)
        if (name == "nonzero" and self.routing is not None and self._is_routed(args[0]) and args[0].dim() == 1
                and args[0].numel() in (self.routing.num_experts, self.routing.num_experts + 1)):
            self.known.note_experts_hit(out, self.routing.num_experts)
        elif name in _PASS_ON and _is_meta(args):
            self.known.propagate(func, args, kwargs, out)
        self._note_learned(args, kwargs, out)
        if name in ("all", "_is_all_true") and _is_meta(args) and isinstance(out, torch.Tensor):
            self.alls.add(id(out))
            self.alive.append(out)
        if name == "topk" and _is_meta(args):
            self._note_router(args, kwargs, out)
        elif name in ("argmax", "max") and _is_meta(args) and self._note_top1(name, args, kwargs, out):
            pass
        elif self.routed and name != "_unique2":  # unique labels its own outputs (values, counts)
            inputs = tree_flatten((args, kwargs))[0]
            if any(self._is_routed(a) for a in inputs):
                # a constant scattered at the routing indices is a one-hot routing mask, float or not
                # (JetMoE's ``zeros.scatter(1, top_k_indices, 1).long().sum(0)`` counts tokens per expert)
                one_hot = func in _SCATTER_VALUE and len(args) > 2 and self._is_routed(args[2])
                self._mark(out, name, inputs, floats=one_hot)
        return out

    def _note_learned(self, args: tuple, kwargs: dict, out: Any) -> None:
        """Float results of an op reading a parameter, or a result of one, are ``learned`` (the
        provenance a top-1 router's scores must have, ``_note_top1``; grad mode may be off)."""
        if not any(isinstance(t, nn.Parameter) or t in self.learned for t in flat_tensors((args, kwargs))):
            return
        for t in flat_tensors(out):
            if t.is_floating_point():
                self.learned[t] = True

    def _count(self) -> None:
        self.ops += 1
        budget = _BUDGETS[-1]
        budget.most = max(budget.most, self.ops)
        if self.ops > budget.limit:
            budget.tripped = True
            raise OpBudgetExceeded(f"a forward on meta dispatched more than {budget.limit} ops")

    def _copy_out(self, t: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """A meta tensor copied to a real device: filled with what its value reads would answer
        (per-expert counts of a routing count, else zeros)."""
        dtype = kwargs.get("dtype") or t.dtype
        known = self.known.get(t)
        if known is not None:
            return known.to(dtype=dtype, device=kwargs["device"])
        value = self.routing.per_expert if self._counts(t) and t.dtype != torch.bool else (
            True if self._counts(t) else 0)
        return torch.full(t.shape, value, dtype=dtype, device=kwargs["device"])

    def _note_top1(self, name: str, args: tuple, kwargs: dict, out: Any) -> bool:
        """A top-1 router (Switch-style): ``scores.argmax(-1)`` or ``scores.max(-1)`` over E <= 1024
        scores of a float tensor that is not itself routed, while no top-k routing is known (a
        vocabulary argmax is wider; an expert-id max is a routed tensor's). The scores must come from
        a parameter (``learned``, or a gradient where autograd records): a router's come from its
        learned projection, while a max over values the model computes from its inputs alone
        (LongT5's global block ids, from the attention mask) picks no expert. True when noted."""
        scores = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not scores.requires_grad and scores not in self.learned:
            return False  # no learned weight behind these scores (LongT5's max over block ids): no router
        if (self.routing is not None or dim is None or not scores.is_floating_point() or scores.dim() < 2
                or int(dim) not in (-1, scores.dim() - 1) or not 2 <= scores.shape[-1] <= 1024):
            return False
        indices = out if name == "argmax" else (out[1] if isinstance(out, (tuple, list)) and len(out) == 2 else None)
        if not isinstance(indices, torch.Tensor):
            return False
        # a router's pick is read (to gather, mask or count the experts' tokens); a max whose indices
        # nothing reads is a max (xLSTM's stabiliser, ``gates.max(-1).values``): the routing holds
        # only once an op reads the indices (``_confirm_top1``)
        self.tentative[id(indices)] = Routing(tokens=scores.numel() // scores.shape[-1], top_k=1,
                                              num_experts=scores.shape[-1])
        self._mark(indices, "topk")
        return True

    def _confirm_top1(self, args: tuple, kwargs: dict) -> None:
        """The routing of a top-1 pick (``_note_top1``) once an op reads its indices."""
        for t in flat_tensors((args, kwargs)):
            routing = self.tentative.get(id(t))
            if routing is not None:
                if self.routing is None:
                    self.routing = routing
                self.tentative.clear()
                return

    def _note_router(self, args: tuple, kwargs: dict, out: Any) -> None:
        scores, k = args[0], int(args[1] if len(args) > 1 else kwargs.get("k", 1))
        dim = int(args[2] if len(args) > 2 else kwargs.get("dim", -1))
        if scores.dim() < 1 or dim not in (-1, scores.dim() - 1) or not 1 <= k < scores.shape[-1]:
            return
        self.routing = Routing(tokens=scores.numel() // scores.shape[-1], top_k=k, num_experts=scores.shape[-1])
        self._mark(out[1], "topk")


@contextmanager
def tolerant_meta() -> Iterator[_TolerantMeta]:
    """Answer value reads and data-dependent shapes of meta tensors (see the module docstring)
    inside this block. The mode it yields holds ``routing``: the last top-k routing seen (or None)."""
    with _TolerantMeta() as mode, meta_format():
        yield mode
