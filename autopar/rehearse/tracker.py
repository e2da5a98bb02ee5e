"""One training step under torch's memory tracker, the peak split into autopar's parts.

``torch.distributed._tools.mem_tracker.MemTracker`` counts every storage an op creates (forward,
backward, recompute, optimizer), rounded up to the CUDA caching allocator's 512-byte blocks, and
labels it: parameter, buffer, gradient, activation (made in forward or recompute), temporary (made
in backward), optimizer state. It works on fake tensors: storage sizes are known without data.

A training step runs the root module once per micro-batch (gradient accumulation, pipeline
schedules); MemTracker takes a second forward of a root module for the next iteration and stops
(its per-module statistics assume one). ``StepTracker`` starts a root module's statistics afresh at
each of its forwards instead; the totals and the peak it keeps are per storage, so they are exact.
It also keeps only the step's global peak: MemTracker updates every active module's own peak after
every op, which was half of a rehearsal's time (a 70 B model has ~10^3 modules, a step ~10^5 ops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

# MemTracker's labels -> the parts autopar reports (the cost model's, with temporaries apart)
PARTS = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer", "Activation": "activations",
         "Temp": "temporaries", "Buffer": "temporaries", "Other": "temporaries"}


class StepTracker(MemTracker):
    """MemTracker for a whole training step of many micro-batches (module docstring)."""

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:  # a root's next micro-batch
                self.memory_tracking.pop(module)
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)


@dataclass(frozen=True, kw_only=True)
class PeakMemory:
    """The step's peak: total tensor bytes and the parts alive at that moment."""

    peak_bytes: float
    parts: dict[str, float]


def peak_of(tracker: MemTracker) -> PeakMemory:
    """The peak snapshot of ``tracker`` summed over devices, by part."""
    parts = dict.fromkeys(dict.fromkeys(PARTS.values()), 0.0)
    total = 0.0
    for snap in tracker.get_tracker_snapshot("peak").values():
        for key, nbytes in snap.items():
            label = getattr(key, "value", key)
            if label == "Total":
                total += nbytes
            else:
                parts[PARTS[label]] += nbytes
    return PeakMemory(peak_bytes=total, parts=parts)
