"""CPU and activation offload (``parallel.offload``), as autopar.cost.offload prices it.

=====================  =========================================================================
offload                mechanism
=====================  =========================================================================
params (+ grads +      FSDP2 ``fully_shard(offload_policy=CPUOffloadPolicy(pin_memory=...))`` at
optimizer), zero 3     ZeRO-3 (data_parallel.py): sharded parameters and gradients live on the
                       host, FSDP2 copies a shard up before each all-gather and the gradient
                       shard down after each reduce-scatter; the optimizer, built over those host
                       parameters, steps on the CPU. Pinned memory only on CUDA (DESIGN §8: a
                       machine without a GPU cannot pin).
optimizer only         ``HostOptimizer`` (ZeRO-Offload style, which FSDP2 does not offer): an
                       fp32 master copy of each of this rank's (sharded) parameters and the inner
                       optimizer's states on the host; ``step`` copies the gradients down, steps
                       the masters on the CPU and copies the updated values back up, in that order.
activations            ``OffloadSavedTensors`` around each block's forward: every tensor autograd
                       saves (but parameters, which stay where they are) is copied to the host as
                       it is saved and back when backward needs it -- what
                       ``torch.autograd.graph.save_on_cpu`` does, without copying the weights a
                       layer saves (they are already resident, and under FSDP2 re-gathered).
=====================  =========================================================================
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

HOST = torch.device("cpu")


def cpu_offload_policy(device: torch.device) -> Any:
    """FSDP2's CPU offload policy for ranks on ``device`` (pinned host memory only with CUDA)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a view sharing its storage) -- Adam is elementwise, so stepping
    each rank's shard is stepping the whole parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


def _host_like(t: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty(t.shape, dtype=torch.float32, device=HOST, pin_memory=pin)


class HostOptimizer(torch.optim.Optimizer):
    """An optimizer whose states and fp32 master weights live in host memory and whose update runs
    on the CPU (module docstring). ``make_inner(masters)`` builds the real optimizer over the host
    masters (AdamW or SGD from data_parallel.build_optimizer), so the update is exactly that
    optimizer's; ``param_groups`` are the inner optimizer's (a learning-rate schedule works).

    Device parameters held in the training dtype (``host_masters``: bf16 beside fp32 masters) cross
    the link in that dtype through a host staging buffer of it, pinned on CUDA, converted on the
    CPU: a copy between tensors of two dtypes and two devices converts on the GPU when
    non-blocking (the upload then carried fp32, twice the priced bytes, through a device
    temporary) and through an unpinned host temporary when blocking (the download)."""

    def __init__(self, params: Iterable[nn.Parameter], make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 *, pin_memory: bool) -> None:
        self.device_params = [p for p in params if p.requires_grad]
        self._pin = pin_memory
        with torch.no_grad():
            self.masters = []
            for p in self.device_params:
                master = _host_like(_local(p), pin_memory)
                master.copy_(_local(p))
                self.masters.append(master)
        self._index = {id(p): i for i, p in enumerate(self.device_params)}
        # per parameter held in another dtype than its master: a host buffer of its dtype and shape
        self._stage: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.inner = make_inner(self.masters)
        # Not Optimizer.__init__: the inner optimizer owns the groups and the state.
        self.defaults = self.inner.defaults
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("HostOptimizer.step takes no closure")
        if self._stage and self._pin:  # last step's uploads read the staging buffers: done first
            torch.cuda.current_stream(self.device_params[0].device).synchronize()
        for i, (p, master) in enumerate(zip(self.device_params, self.masters)):  # 1. gradients down
            if p.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = _host_like(master, self._pin)
            grad = _local(p.grad)
            if grad.dtype != master.dtype:  # the training dtype over the link, converted on the host
                grad = self._staging(i, grad).copy_(grad)
            master.grad.copy_(grad)
        self.inner.step()  # 2. the update, on the CPU
        for i, (p, master) in enumerate(zip(self.device_params, self.masters)):  # 3. updated values up
            local = _local(p)
            src = self._staging(i, local).copy_(master) if local.dtype != master.dtype else master
            local.copy_(src, non_blocking=self._pin)

    def _staging(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s host buffer in ``like``'s dtype and shape (pinned on CUDA), made once."""
        stage = self._stage.get((i, like.dtype))
        if stage is None:
            stage = torch.empty(like.shape, dtype=like.dtype, device=HOST, pin_memory=self._pin)
            self._stage[(i, like.dtype)] = stage
        return stage

    def host_copy(self, p: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """The fp32 master of device parameter ``p`` and the inner optimizer's state of it (what a
        checkpoint saves and loads in place of the device's copy); None for a parameter it does
        not step."""
        i = self._index.get(id(p))
        if i is None:
            return None
        master = self.masters[i]
        return master, self.inner.state.get(master, {})

    @torch.no_grad()
    def push_masters(self) -> None:
        """Copy every master up to its device parameter (after a checkpoint loaded the masters)."""
        for p, master in zip(self.device_params, self.masters):
            _local(p).copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


class _HostStorage:
    """One device storage's bytes on the host, shared by every saved view of it (softmax saves its
    output, the next matmul a view of it: the device holds those bytes once, so the host copies and
    returns them once). Brought back once: a later view is built on the storage an earlier
    unpacked view still holds."""

    __slots__ = ("host", "device", "_back")

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host, self.device, self._back = host, device, None

    def view(self, dtype: torch.dtype, size: tuple, stride: tuple, offset: int, non_blocking: bool) -> torch.Tensor:
        alive = self._back() if self._back is not None else None
        storage = alive.untyped_storage() if alive is not None else \
            self.host.to(self.device, non_blocking=non_blocking).untyped_storage()
        out = torch.empty(0, dtype=dtype, device=self.device).set_(storage, offset, size, stride)
        self._back = weakref.ref(out)
        return out


class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors to host memory on save, back to their device on use (parameters and views of
    them excepted). A storage saved through several views (within one block's forward: one
    instance) is copied once and restored once. ``host_bytes`` counts the bytes copied to the host
    by every instance (what explain prices as activation offload traffic, one direction)."""

    host_bytes = 0

    def __init__(self, pin_memory: bool) -> None:
        copies: dict[int, tuple[weakref.ref, _HostStorage]] = {}

        def host_storage(t: torch.Tensor, local: torch.Tensor) -> _HostStorage:
            storage = local.untyped_storage()
            hit = copies.get(storage.data_ptr())
            # the first view still alive: its storage is, so the address is not a new allocation's
            if hit is not None and hit[0]() is not None and hit[1].host.numel() == storage.nbytes():
                return hit[1]
            whole = torch.empty(0, dtype=torch.uint8, device=local.device).set_(storage)
            host = torch.empty(whole.numel(), dtype=torch.uint8, device=HOST, pin_memory=pin_memory)
            host.copy_(whole)  # on a CPU rank the host is the device: the copy still runs (same code path)
            OffloadSavedTensors.host_bytes += host.numel()
            shared = _HostStorage(host, local.device)
            copies[storage.data_ptr()] = (weakref.ref(t), shared)
            return shared

        def pack(t: torch.Tensor) -> Any:
            if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
                # a weight, or a view of one (Linear saves weight.t(); under TP a DTensor view, under
                # FSDP2 a view of the unsharded parameter): resident anyway, so not an activation
                # to copy (FSDP2 re-gathers it for backward). An autocast copy is not a view: it goes.
                return t
            local = t.to_local() if isinstance(t, DTensor) else t
            if isinstance(local, AsyncCollectiveTensor):  # a functional collective's (TP's) result
                local = local.wait()
            try:  # restore(non_blocking=...) brings the saved tensor back to its device
                restore = functools.partial(host_storage(t, local).view, local.dtype, tuple(local.shape),
                                            tuple(local.stride()), local.storage_offset())
            except RuntimeError:  # no plain storage (a wrapper subclass's): the tensor's own bytes
                host = torch.empty(local.shape, dtype=local.dtype, device=HOST, pin_memory=pin_memory)
                host.copy_(local)
                OffloadSavedTensors.host_bytes += host.numel() * host.element_size()
                restore = functools.partial(host.to, local.device)
            if isinstance(t, DTensor):
                return ("dtensor", restore, t.device_mesh, t.placements, t.shape, t.stride())
            return ("tensor", restore)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            local = packed[1](non_blocking=pin_memory)
            if packed[0] == "tensor":
                return local
            _, _, mesh, placements, shape, stride = packed
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

        super().__init__(pack, unpack)


def offload_block_activations(blocks: Iterable[nn.Module], device: torch.device) -> int:
    """Run each block's forward inside ``OffloadSavedTensors``; returns the number of blocks."""
    pin = device.type == "cuda"
    count = 0
    for block in blocks:
        ctx: list[OffloadSavedTensors] = []

        def enter(_module: nn.Module, _args: Any, ctx: list = ctx) -> None:
            hooks = OffloadSavedTensors(pin)
            hooks.__enter__()
            ctx.append(hooks)

        def leave(_module: nn.Module, _args: Any, _out: Any, ctx: list = ctx) -> None:
            ctx.pop().__exit__(None, None, None)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave, always_call=True)
        count += 1
    return count


def host_step_threads(device: torch.device, cpu_count: int | None, local_world: int) -> int | None:
    """Intra-op threads for the host optimizer's step on a GPU rank: its share of the node's cores
    (the step is CPU work, priced at the host's vectorised rate, and ranks start with
    OMP_NUM_THREADS=1 under torchrun and autopar's launcher). None on a CPU rank, which has its share
    already (rank_main)."""
    if device.type == "cpu":
        return None
    return max(1, (cpu_count or 1) // max(1, local_world))


def build_host_optimizer(params: list[nn.Parameter], make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                         device: torch.device) -> HostOptimizer:
    """The optimizer-only offload of ``params`` (module docstring)."""
    threads = host_step_threads(device, os.cpu_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    if threads is not None:
        torch.set_num_threads(threads)
    return HostOptimizer(params, make_inner, pin_memory=device.type == "cuda")
