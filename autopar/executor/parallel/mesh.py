"""The device mesh of a plan: ranks laid out ``[pp, dp, cp, tp]``, tp innermost (autopar/layout.py).

``build_mesh`` must be called by every rank (DeviceMesh creates the sub-groups collectively). All
groups the executor uses come from this one mesh, so DTensor TP, FSDP2 sharding and the pipeline's
P2P all agree on which rank is which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.layout import DIMS, Coords
from autopar.plan import Plan

MESH_DIMS = DIMS  # the DeviceMesh's dimension names, outermost first


def rank_coords(rank: int, plan: Plan) -> Coords:
    """Coordinates of global ``rank`` in the row-major ``[pp, dp, cp, tp]`` layout."""
    return plan.parallel.layout.coords(rank)


@dataclass(frozen=True, kw_only=True)
class ParallelMesh:
    """The world mesh plus the sub-meshes and groups each parallelism uses.

    ``dp_cp`` is the mesh that gradients are averaged / ZeRO-sharded over: data parallelism and
    context parallelism both split the tokens of one step, so both take part (docs/design.md §5:
    model states are sharded over ``N = dp · cp``).
    """

    world: DeviceMesh
    coords: Coords
    device: torch.device
    plan: Plan

    @property
    def pp(self) -> DeviceMesh:
        return self.world["pp"]

    @property
    def dp(self) -> DeviceMesh:
        return self.world["dp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.world["cp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.world["tp"]

    @property
    def dp_cp(self) -> DeviceMesh:
        """1-D mesh over dp x cp (flattened once, cached by DeviceMesh under the name ``dp_cp``)."""
        if self.plan.parallel.cp == 1:
            return self.dp
        if self.plan.parallel.dp == 1:
            return self.cp
        return self.world["dp", "cp"]._flatten("dp_cp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.pp.get_group()

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.cp.get_group()


DEVICE_ENV = "AUTOPAR_DEVICE"  # cpu | cuda | auto: what run / validate --device set for every rank
DEVICES = ("auto", "cpu", "cuda")


def chosen_device_type() -> str:
    """"cuda" or "cpu": what ``device_for_rank`` gives this host's ranks (``AUTOPAR_DEVICE``)."""
    import os

    choice = os.environ.get(DEVICE_ENV, "auto") or "auto"
    return "cpu" if choice == "cpu" or not torch.cuda.is_available() else "cuda"


PINNED_ROUND_MB = 16  # pinned host buffers above this size are not rounded up (device_for_rank)


def device_for_rank() -> torch.device:
    """This rank's device: ``AUTOPAR_DEVICE`` (``--device``) cpu, cuda, or auto (CUDA when present,
    else CPU with gloo). On CUDA each rank takes GPU ``LOCAL_RANK``, which must exist: a host showing
    fewer GPUs than ranks is a one-line AutoparError, not an invalid-ordinal traceback. The caching
    allocator grows segments in place (``expandable_segments``), as the cost model assumes: it prices
    no fragmentation (docs/cost-model.md); a user's own ``PYTORCH_CUDA_ALLOC_CONF`` is kept."""
    import os

    from autopar.errors import AutoparError

    choice = os.environ.get(DEVICE_ENV, "auto") or "auto"
    if choice not in DEVICES:
        raise AutoparError(f"{DEVICE_ENV}={choice!r}: use one of {', '.join(DEVICES)} (autopar run --device)")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise AutoparError("--device cuda: no CUDA device is visible to this process (a CPU-only torch, or "
                           "CUDA_VISIBLE_DEVICES empty); use --device cpu")
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        raise AutoparError(f"local rank {local} has no GPU: this host shows {count} CUDA device(s); start at most "
                           f"{count} rank(s) per node (--nproc-per-node {count}), or run on the CPU with --device cpu")
    user_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    torch.cuda.set_device(local)
    # fp32 matmuls on TF32 tensor cores, as the profiles price an fp32 plan (Cluster.fp32_peak_flops);
    # bf16 and fp16 plans are unaffected
    torch.set_float32_matmul_precision("high")
    settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if settings is not None and "pinned" not in user_conf:
        # Host offload's pinned buffers (activations, the host optimizer's masters): the caching host
        # allocator rounds each one up to a power of two, up to 2x the host memory priced
        # (cost/offload.py); above PINNED_ROUND_MB they are kept at their size. A torch without
        # the setting ignores it.
        settings(f"pinned_max_round_threshold_mb:{PINNED_ROUND_MB}")
    return torch.device("cuda", local)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


_MESHES: dict[tuple, DeviceMesh] = {}


def build_mesh(plan: Plan, device: torch.device) -> ParallelMesh:
    """Create the ``[pp, dp, cp, tp]`` mesh. The process group must already be initialised.

    Meshes are cached per (shape, device type, default group): every DeviceMesh creates one process
    group per axis, and a process that runs many plans (the tests) should not pile up hundreds.
    """
    shape = plan.parallel.layout.shape
    key = (shape, device.type, id(dist.distributed_c10d._get_default_group()))
    world = _MESHES.get(key)
    if world is None:
        world = _MESHES[key] = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
    return ParallelMesh(world=world, coords=rank_coords(dist.get_rank(), plan), device=device, plan=plan)
