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
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of storages allocated by ops run inside and still alive (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, weakref.finalize] = {}

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and not _is_meta(t)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or _is_meta(t):
                continue
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0 or key in inputs or key in self._refs:
                continue
            self._refs[key] = weakref.finalize(st, self._free, key, nbytes)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


def _is_meta(t: Any) -> bool:
    return t.device.type == "meta"
