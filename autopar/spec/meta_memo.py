"""Meta kernels answered from a memo of what they returned for the same input metadata.

A meta kernel computes an op's output shape, strides and dtype from its inputs' metadata and its
other arguments, never from data (there is none). Many of torch's are Python reference
implementations (element-wise ops broadcast and pick a memory format in ``torch._refs``) that cost
0.1-2 ms a call on a CPU, against ~4 us to allocate the meta tensor they describe. Measuring a model
runs the same ops on the same shapes over and over -- every block of a block list, every position
of a Python loop over the sequence (RWKV's and Jamba's reference scans dispatch tens of thousands),
every probe and trace of the same model -- so the second and later calls are answered from the
first one's output metadata.

Only what is a function of the key is memoised: ops that neither write an input nor return a view
(their schema says so), on plain strided meta tensors, with hashable non-tensor arguments (ints,
floats, bools, strings, dtypes, devices, memory formats, and sequences of them), with the default
dtype in the key (factory-like ops read it), and only where no other dispatch mode sits below the
caller (one would otherwise not see the op). An output on one of the inputs' storage is never
memoised (``_unsafe_view`` returns a view its schema does not declare). A miss runs the kernel as
before, so a kernel that raises still raises every time.
"""

from __future__ import annotations

from typing import Any

import torch

MAX_ENTRIES = 50_000  # a memo this large is cleared rather than grown (one model's ops fit many times over)

_MEMO: dict[tuple, tuple] = {}
_PURE: dict[Any, bool] = {}  # op overload -> it writes no input and returns no alias
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # no dispatch of their own: metadata alone decides a kernel's output


class _Unkeyable(Exception):
    """An argument whose metadata does not determine the output (or cannot be hashed)."""


def memo_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The memo key of ``func(*args, **kwargs)`` on meta, or None where the call is not memoisable."""
    if torch._C._len_torch_dispatch_stack() != 0 or not _is_pure(func):
        return None
    try:
        return (func, torch.get_default_dtype(), _key(args), _key(tuple(sorted(kwargs.items()))))
    except _Unkeyable:
        return None


def lookup(key: tuple) -> Any:
    """Fresh meta tensors shaped as the memoised output of ``key``; None on a miss."""
    meta = _MEMO.get(key)
    return None if meta is None else _build(meta)


def remember(key: tuple, args: tuple, kwargs: dict, out: Any) -> None:
    """Record ``out``'s metadata under ``key`` (skipped where ``out`` is not fresh meta tensors)."""
    try:
        meta = _describe(out, {t.untyped_storage()._cdata for t in flat_tensors((args, kwargs))})
    except _Unkeyable:
        return
    if len(_MEMO) >= MAX_ENTRIES:
        _MEMO.clear()
    _MEMO[key] = meta


def _is_pure(func: Any) -> bool:
    pure = _PURE.get(func)
    if pure is None:
        schema = getattr(func, "_schema", None)
        pure = schema is not None and bool(schema.returns) and not any(
            a.alias_info is not None for a in (*schema.arguments, *schema.returns))
        _PURE[func] = pure
    return pure


def _key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if type(x) not in _PLAIN or not x.is_meta or x.layout != torch.strided:
            raise _Unkeyable
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.is_conj(), x.is_neg())
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, *(_key(v) for v in x))
    if isinstance(x, _SCALARS) and not isinstance(x, torch.SymInt):
        return (type(x).__name__, x)
    raise _Unkeyable


def flat_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in an aten call's arguments or results (tensors, sequences, dicts), in pytree order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in flat_tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in flat_tensors(v)]
    return []


def _describe(out: Any, input_storages: set[int]) -> tuple:
    if isinstance(out, torch.Tensor):  # a result on an input's storage is a view its schema does not declare
        if (type(out) is not torch.Tensor or not out.is_meta or out.layout != torch.strided
                or out.untyped_storage()._cdata in input_storages
                or out.storage_offset() != 0 or out.is_conj() or out.is_neg()):
            raise _Unkeyable
        return ("T", tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, (tuple, list)):
        return (type(out).__name__, *(_describe(v, input_storages) for v in out))
    if out is None:
        return ("N",)
    raise _Unkeyable


def _build(meta: tuple) -> Any:
    tag = meta[0]
    if tag == "T":
        return torch.empty_strided(meta[1], meta[2], dtype=meta[3], device="meta")
    if tag == "N":
        return None
    parts = [_build(m) for m in meta[1:]]
    return parts if tag == "list" else tuple(parts)
