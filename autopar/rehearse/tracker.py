"""One training step under torch's memory tracker, the peak split into autopar's parts.

``torch.distributed._tools.mem_tracker.MemTracker`` counts every storage an op creates (forward,
backward, recompute, optimizer) and labels it: parameter, buffer, gradient, activation (made in
forward or recompute), temporary (made in backward), optimizer state. It works on fake tensors:
storage sizes are known without data. A rehearsal's fake tensors live on the CPU device, so sizes
are exact bytes, not rounded up to the CUDA caching allocator's 512-byte blocks (at full scale a
difference far below a percent).

A training step runs the root module once per micro-batch (gradient accumulation, pipeline
schedules); MemTracker takes a second forward of a root module for the next iteration and stops
(its per-module statistics assume one). ``StepTracker`` starts a root module's statistics afresh at
each of its forwards instead; the totals and the peak it keeps are per storage, so they are exact.
It also keeps only the step's global peak: MemTracker updates every active module's own peak after
every op, which was half of a rehearsal's time (a 70 B model has ~10^3 modules, a step ~10^5 ops).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from torch.distributed._tools.mem_tracker import MemTracker

# MemTracker's labels -> the parts autopar reports (the cost model's, with temporaries apart)
PARTS = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer", "Activation": "activations",
         "Temp": "temporaries", "Buffer": "temporaries", "Other": "temporaries"}


class _NoHook:
    """The handle of a gradient hook never registered (``StepTracker._track_module_params_and_buffers``)."""

    @staticmethod
    def remove() -> None:
        return None


_NO_HOOK = _NoHook()


class StepTracker(MemTracker):
    """MemTracker for a whole training step of many micro-batches (module docstring), whose peak is
    the *device's*: a rehearsal runs on one CPU device, where host offload's tensors live beside
    the rest, so what a real run keeps on the host is named and left out of the peak at every op
    (``host_labels``: the MemTracker labels that live on the host -- optimizer states under any
    optimizer offload, gradients under FSDP2's parameter offload; ``host_param_bytes``: the
    parameters' sharded copies FSDP2 keeps on the host). The host's own peak is kept apart."""

    def __init__(self, host_labels: tuple[str, ...] = (), host_param_bytes: float = 0.0) -> None:
        super().__init__()
        self.host_labels, self.host_param_bytes = host_labels, host_param_bytes
        self.device_peak = -1.0
        self.device_peak_snap: dict[str, float] = {}
        self._unseen = 0  # > 0 inside DTensor's sharding propagation (``__enter__``)

    def __enter__(self) -> "StepTracker":
        """Tracking, with DTensor's sharding propagation left out of the peak: to know an op's output
        shape, DTensor runs the op once on fake tensors of the *global* shapes (the whole logits of
        a vocabulary-parallel loss, say). On a real run those are fake and cost nothing; in a
        rehearsal the same fake tensors are indistinguishable from the step's own, and would show
        up as a transient of the unsharded size at the moment the loss is computed."""
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(prop: Any, *args: Any, **kwargs: Any) -> Any:
            self._unseen += 1
            try:
                return original(prop, *args, **kwargs)
            finally:
                self._unseen -= 1

        self._restore = lambda: setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", original)
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
        try:
            super().__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._restore()

    def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
        """MemTracker's, for models with frozen parameters too: it registers a gradient hook on every
        parameter of a module it enters, which torch refuses for one that does not require grad
        (ViTMAE's fixed sin-cos position tables; a LoRA's frozen base weights). Such a parameter never
        gets a gradient: it is marked hooked with handles that remove nothing."""
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks=install_grad_hooks)

    @contextlib.contextmanager
    def off_device(self) -> Iterator[None]:
        """Ops whose allocations a real run makes on the host -- a host optimizer's step on the CPU
        (optimizer or parameter offload): its fp32 gradient copies and the update's temporaries --
        left out of the device peak, as DTensor's sharding propagation is (``__enter__``). They touch
        no device tensor but in place, and are freed by the step's end (its gradients set to None)."""
        self._unseen += 1
        try:
            yield
        finally:
            self._unseen -= 1

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:  # a root's next micro-batch
                self.memory_tracking.pop(module)
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        if self._unseen:
            return
        total, merged = 0.0, {}
        for snap in self._curr_mem_snap.values():
            for key, nbytes in snap.items():
                label = getattr(key, "value", key)
                merged[label] = merged.get(label, 0.0) + nbytes
        host = sum(merged.get(label, 0.0) for label in self.host_labels) + self.host_param_bytes
        total = merged.get("Total", 0.0) - host
        if total > self.device_peak:
            self.device_peak, self.device_peak_snap = total, merged


@dataclass(frozen=True, kw_only=True)
class PeakMemory:
    """The step's device peak: tensor bytes and the parts alive at that moment (host-resident
    ones left out, and reported as ``parts["host"]``)."""

    peak_bytes: float
    parts: dict[str, float]
    origins: tuple = ()  # why.LiveGroup: the largest groups alive at the peak (``rehearse --why``)


def peak_of(tracker: StepTracker) -> PeakMemory:
    """The device peak of ``tracker``, by part."""
    parts = dict.fromkeys(dict.fromkeys(PARTS.values()), 0.0)
    snap = tracker.device_peak_snap
    host = tracker.host_param_bytes
    for label, nbytes in snap.items():
        if label == "Total":
            continue
        if label in tracker.host_labels:
            host += nbytes
        else:
            parts[PARTS[label]] += nbytes
    parts["params"] -= tracker.host_param_bytes
    return PeakMemory(peak_bytes=max(0.0, tracker.device_peak), parts={**parts, "host": host})
