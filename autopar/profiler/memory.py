"""Allocator-level memory of a piece of PyTorch code, on any device (CPU included).

CUDA has allocator statistics (``torch.cuda.max_memory_allocated``); the CPU allocator has none
(and ``torch.profiler``'s CPU memory events are empty on this torch build). ``LiveBytes`` measures
the same quantity on every device: a ``TorchDispatchMode`` that sees every aten op (forward and
backward), counts each *new* storage an op allocates (outputs aliasing an input -- views, in-place
ops -- are not new) and uncounts it when the storage is freed (a weakref finaliser on the storage:
PyTorch keeps a storage's Python object alive as long as its C++ storage, so the finaliser fires on
the real free). ``live_bytes`` is what is allocated now, ``peak_bytes`` its maximum since ``reset``.

Parameters, inputs and anything allocated before entering the mode are not counted: the measure is
the activations, gradients and temporaries of the code run inside, i.e. what the cost model's
"activations" (and transient buffers) stand for. It does not include allocator slack or RSS.

One allocation path bypasses the dispatcher: FSDP2 grows and shrinks the storages of its unsharded
parameters in place (``alloc_storage`` / ``free_storage``, ``UntypedStorage.resize_``). Inside
``step_allocated_bytes`` those two are wrapped so that the bytes they add or drop count too.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage(t: Any) -> Any:
    """The storage behind ``t``: a DTensor's local shard, a pending functional collective's result;
    None for a tensor without one of its own (meta, other wrapper subclasses)."""
    while True:
        inner = getattr(t, "_local_tensor", None)
        if inner is None:
            inner = getattr(t, "elem", None) if type(t).__name__ == "AsyncCollectiveTensor" else None
        if inner is None:
            break
        t = inner
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class LiveBytes(TorchDispatchMode):
    """Bytes of storages allocated by ops run inside and still alive (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, weakref.finalize] = {}

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def adjust(self, nbytes: int) -> None:
        """Count ``nbytes`` (negative: freed) allocated outside the dispatcher."""
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = {st.data_ptr() for st in (_storage(t) for t in tree_flatten((args, kwargs))[0]
                                           if isinstance(t, torch.Tensor)) if st is not None}
        for t in tree_flatten(out)[0]:
            st = _storage(t) if isinstance(t, torch.Tensor) else None
            if st is None:
                continue
            key, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0 or key in inputs or key in self._refs:
                continue
            self._refs[key] = weakref.finalize(st, self._free, key, nbytes)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


def resident_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an iterable; None entries skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = _storage(t) if isinstance(t, torch.Tensor) else None
        if st is not None and st.nbytes() > 0:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def step_allocated_bytes(tensors_before: Any, run_step: Any) -> tuple[int, int]:
    """Allocator-level peak of one training step on any device (CPU included):
    (bytes alive before it -- ``tensors_before``: parameters, buffers, optimizer states, gradient
    buckets --, peak of what the step's ops allocate on top, ``LiveBytes``). The sum is the CPU
    counterpart of ``torch.cuda.max_memory_allocated`` over that step: tensors only, no allocator
    slack, no communication library buffers."""
    before = resident_bytes(tensors_before)
    live = LiveBytes()
    with live, _fsdp_resizes(live):
        run_step()
    return before, live.peak_bytes


@contextmanager
def _fsdp_resizes(live: LiveBytes) -> Iterator[None]:
    """FSDP2's in-place storage resizes (module docstring) counted in ``live``."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError:  # a torch without FSDP2
        yield
        return
    modules = (_fsdp_param, _fsdp_param_group)
    saved = [(m, name, getattr(m, name)) for m in modules for name in ("alloc_storage", "free_storage")
             if hasattr(m, name)]

    def counted(fn: Any) -> Any:
        def resize(tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            was = storage.nbytes()
            fn(tensor)
            live.adjust(storage.nbytes() - was)
        return resize

    for m, name, fn in saved:
        setattr(m, name, counted(fn))
    try:
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
