"""Running a user's forward on the meta device, where data-dependent code has no data.

Real model code asks its tensors for values now and then: Hugging Face's packed-sequence check calls
``.item()``, masks test ``bool(tensor)``. Meta tensors hold no values, so those calls raise.
``tolerant_meta()`` answers them instead, with the value of the common training path (0 / False:
no packed sequences, no padding detected), so that a forward runs through and its shapes, FLOPs and
saved tensors can be measured. Every op still runs as PyTorch dispatches it; only value reads are
answered.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_VALUE_READS = {"_local_scalar_dense", "is_nonzero", "equal"}


def _default_value(func: Any, args: tuple) -> Any:
    name = func._overloadpacket.__name__
    if name in ("is_nonzero", "equal"):
        return False
    t = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if t is not None and t.dtype == torch.bool:
        return False
    if t is not None and t.is_floating_point():
        return 0.0
    return 0


class _TolerantMeta(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if func._overloadpacket.__name__ in _VALUE_READS and any(
                isinstance(a, torch.Tensor) and a.is_meta for a in args):
            return _default_value(func, args)
        return func(*args, **kwargs)


@contextmanager
def tolerant_meta() -> Iterator[None]:
    """Answer value reads of meta tensors (see the module docstring) inside this block."""
    with _TolerantMeta():
        yield
