"""Which row-parallel layers of a block have their output modified in place by the block's code.

Under tensor parallelism a rowwise layer's output reaches the block's code through DTensor's
``to_local()``, which returns a view made inside an autograd Function. PyTorch forbids modifying such
a view in place ("Output 0 of _ToTorchTensor is a view and is being modified inplace"), and some real
models do exactly that: Falcon's parallel attention adds ``mlp_output += attention_output``. The
executor hands those layers' outputs on as a copy (executor/parallel/tensor_parallel.py); every other layer
keeps the copy-free view, which is why this is decided per layer and not for all of them.

``inplace_outputs`` answers from one meta forward of the model: a dispatch mode follows each rowwise
output of block 0 and every tensor that aliases it (views, in-place results), and records the layer
when an op writes to one of them (an argument whose schema marks it written). Needs torch, never
torch.distributed.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _WriteWatch(TorchDispatchMode):
    """Records the layers whose followed outputs (or aliases of them) an op writes to."""

    def __init__(self) -> None:
        super().__init__()
        self.owner: dict[int, str] = {}  # id(tensor) -> layer name
        self.keep: list[torch.Tensor] = []  # keeps followed tensors alive, so ids stay unique
        self.written: set[str] = set()

    def follow(self, t: torch.Tensor, name: str) -> None:
        self.owner[id(t)] = name
        self.keep.append(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        followed: str | None = None
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if not isinstance(value, torch.Tensor) or id(value) not in self.owner:
                continue
            name = self.owner[id(value)]
            info = arg.alias_info
            if info is not None and info.is_write:
                self.written.add(name)
            if info is not None:
                followed = name
        out = func(*args, **kwargs)
        if followed is not None and any(r.alias_info is not None for r in schema.returns):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.follow(t, followed)  # a view or the in-place result: the same storage
        return out


def _first_tensor(value: Any) -> torch.Tensor | None:
    return next((t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)), None)


def inplace_outputs(block: nn.Module, styles: Mapping[str, str], run: Callable[[], Any]) -> tuple[str, ...]:
    """The rowwise layers of ``block`` (names as in ``styles``) whose output the forward ``run()``
    modifies in place, sorted. Never raises: the user's code runs here, and a failure answers ()
    (the executor then keeps the view, as before)."""
    rows = [n for n, s in styles.items() if s == "rowwise"]
    if not rows:
        return ()
    watch = _WriteWatch()
    handles = []

    def hook(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def record(m: nn.Module, a: Any, out: Any) -> None:
            t = _first_tensor(out)
            if t is not None:
                watch.follow(t, name)
        return record

    try:
        for name in rows:
            handles.append(block.get_submodule(name).register_forward_hook(hook(name)))
        with torch.no_grad(), watch:
            run()
    except Exception:  # noqa: BLE001 - the user's forward on meta; the spec reports its failures elsewhere
        return ()
    finally:
        for h in handles:
            h.remove()
    return tuple(sorted(watch.written))
