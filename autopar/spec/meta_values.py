"""Values that a forward on the meta device can know although meta tensors hold none: which experts
a balanced routing hits, and what the model's code computes from that list.

A mixture of experts often loops over the experts that received tokens and picks each one by the
index it read from a tensor: ``for i in mask.sum(...).nonzero(): experts[i]`` (a ``ModuleList``,
``operator.index``), or ``experts[f"expert_{i[0]}"]`` (a ``ModuleDict`` keyed by a formatted 0-d
tensor; HF Switch Transformers). Under balanced routing (spec/meta.py) every expert is hit, so the
list is ``arange(E)``. ``KnownValues`` holds such small integer tensors as real CPU copies beside
their meta twins and carries them through views and picks (``unbind``, ``select``, ``squeeze``...),
so that each loop iteration reads its own expert id -- without it every read answered 0, and the
loop ran expert 0 E times: the right FLOPs, but the other experts' parameters never in the graph.

``meta_format()``: ``Tensor.__format__`` of a 0-d meta tensor formats the tensor's repr instead of
reading its value (it calls no aten op, so no dispatch mode sees it); inside the block it reads the
value the way ``.item()`` does, which the active tolerant mode answers.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

from autopar.spec.meta_memo import flat_tensors

_MAX_KNOWN = 4096  # elements: only small index tensors are followed


class KnownValues:
    """Real CPU values of some meta tensors (by id; the meta tensors are kept alive so ids stay theirs)."""

    def __init__(self) -> None:
        self._values: dict[int, torch.Tensor] = {}
        self._alive: list[torch.Tensor] = []

    def get(self, t: Any) -> torch.Tensor | None:
        return self._values.get(id(t)) if isinstance(t, torch.Tensor) else None

    def set(self, t: torch.Tensor, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(t.shape) or value.numel() > _MAX_KNOWN:
            return
        self._values[id(t)] = value
        self._alive.append(t)

    def note_experts_hit(self, out: torch.Tensor, num_experts: int) -> None:
        """``out``: the (E, 1) nonzero indices of a 1-d "which experts were hit" mask: arange(E)."""
        if out.dim() == 2 and out.shape == (num_experts, 1):
            self.set(out, torch.arange(num_experts, dtype=out.dtype).unsqueeze(1))

    def propagate(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """``out`` of a view or pick whose every meta tensor input is known: the same op on the copies."""
        metas = [a for a in flat_tensors((args, kwargs)) if a.is_meta]
        if not metas or any(id(a) not in self._values for a in metas):
            return

        def real(a: Any) -> Any:
            return self._values[id(a)] if isinstance(a, torch.Tensor) and a.is_meta else a

        try:
            got = func(*tree_map(real, args), **tree_map(real, kwargs))
        except Exception:  # noqa: BLE001 - an op the copies cannot run: the value stays unknown
            return
        for m, r in zip(tree_flatten(out)[0], tree_flatten(got)[0]):
            if isinstance(m, torch.Tensor) and isinstance(r, torch.Tensor) and m.is_meta:
                self.set(m, r)


_ORIGINAL_FORMAT = torch.Tensor.__format__


def _format(self: torch.Tensor, spec: str) -> str:
    if self.is_meta and self.dim() == 0 and not self.is_floating_point() and not self.is_complex():
        return format(self.item(), spec)
    return _ORIGINAL_FORMAT(self, spec)


@contextmanager
def meta_format() -> Iterator[None]:
    """Within the block, formatting a 0-d integer meta tensor reads its value (module docstring)."""
    previous = torch.Tensor.__format__
    torch.Tensor.__format__ = _format
    try:
        yield
    finally:
        torch.Tensor.__format__ = previous
