"""What a rehearsed rank holds at its peak, by origin (``autopar rehearse --why N``).

A rehearsal's peak says how much; to say why, ``WhyTracker`` also notes, for every storage an op
creates during the step, the op (``aten.mm``, ``aten._grouped_mm``, ...) and the innermost module
that ran it, and keeps the origins of the storages alive near the device peak: it takes a new
snapshot whenever the peak has grown by more than ``SNAPSHOT_STEP`` since the last one, so the
last snapshot is within that share of the peak (a snapshot at every new peak would cost a pass
over the live storages per op of a forward, whose peak grows at almost every op). ``top_groups``
sums them by part (params, grads, optimizer, activations, temporaries), op and module, block
indices folded (``layers.*``), largest first. Storages no op the tracker sees has made (parameters
and optimizer states made before the step, buffers FSDP2 allocates for its own collectives) are
named by their part only.

How the faults of 2026-12-06 were found (docs/results.md): an executor's combine holding rows x
width sources (``aten.index_add``), the loss's fp32 logits in a layer chain, an expert's Adam
states whole on one rank of four.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from autopar.rehearse.tracker import PARTS, StepTracker

SNAPSHOT_STEP = 0.005  # a new snapshot once the peak has grown by this share (module docstring)
_INDEX = re.compile(r"\.\d+(?=\.|$)")


@dataclass(frozen=True, kw_only=True)
class LiveGroup:
    """Storages alive at a rank's peak with one origin: their part, the op that made them and the
    innermost module it ran in (block indices folded), their bytes and how many."""

    part: str
    op: str
    module: str
    nbytes: float
    count: int


class WhyTracker(StepTracker):
    """``StepTracker`` that keeps the origins of the storages alive near the device peak (module
    docstring); ``live_at_peak``: (bytes, MemTracker label, op, module) of each."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._origin: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._snapshot_peak = 0.0
        self.live_at_peak: list[tuple[float, str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001
        res = super().__torch_dispatch__(func, types, args, kwargs)
        if res is NotImplemented:
            return res
        module = max((p for p in self._mod_tracker.parents if p != "Global"), key=len, default="")
        op = str(getattr(func, "__name__", func)).split(".")[0]
        origin = (f"aten.{op}", _INDEX.sub(".*", module))

        def note(t: torch.Tensor) -> None:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a subclass without a plain storage
                return
            if st not in self._origin:
                self._origin[st] = origin

        tree_map_only(torch.Tensor, note, res)
        return res

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        if self.device_peak > self._snapshot_peak * (1.0 + SNAPSHOT_STEP):
            self._snapshot_peak = self.device_peak
            self.live_at_peak = [
                (float(w.mem_consumed), str(getattr(w.reftype, "value", w.reftype)),
                 *self._origin.get(st, ("", "")))
                for st, (w, _) in list(self._WINFO.items()) if w.mem_consumed > 0]


def top_groups(tracker: WhyTracker, n: int) -> tuple[LiveGroup, ...]:
    """The ``n`` largest groups of ``tracker``'s storages alive at its last snapshot, host-resident
    parts (offload) left out."""
    sums: dict[tuple[str, str, str], list[float]] = {}
    for nbytes, label, op, module in tracker.live_at_peak:
        if label in tracker.host_labels:
            continue
        key = (PARTS.get(label, "temporaries"), op, module)
        acc = sums.setdefault(key, [0.0, 0.0])
        acc[0] += nbytes
        acc[1] += 1
    ranked = sorted(sums.items(), key=lambda kv: -kv[1][0])[:n]
    return tuple(LiveGroup(part=p, op=op, module=mod, nbytes=b, count=int(c)) for (p, op, mod), (b, c) in ranked)


def format_groups(rank: int, groups: tuple[LiveGroup, ...], scale: float, unit: str) -> str:
    """``autopar rehearse --why``'s lines for one rank."""
    from autopar.report import table

    rows = [[g.part, g.op or "(no op seen)", g.module or "-", f"{g.nbytes / scale:.2f}", str(g.count)]
            for g in groups]
    head = ["part", "made by", "in module", unit, "tensors"]
    return f"rank {rank}: the largest groups of tensors alive at its peak\n" + table(head, rows, align="lllrr")
