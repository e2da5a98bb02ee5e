"""A sharded tensor's full value, gathered over its mesh's own device: a shard may live on the host.

FSDP2's CPU offload (ZeRO-3 ``offload.params``) keeps each parameter's shard, and its gradient's,
on the host while the DTensor's mesh is the GPUs'; the optimizer offload's masters are built the
same way (checkpoint.py ``_shaped_as``). ``DTensor.full_tensor`` all-gathers the local tensor where
it lies, and NCCL takes no host tensors -- on CPU ranks (gloo, where the tests run) shard and mesh
are both on the host and it works. Here such a shard goes to the mesh's device first (the all-gather
buffer is what a ZeRO-3 forward gathers anyway), so full-parameter reads (``apply.full_parameters``:
``--grad-norms``, the equivalence harness) and the checkpoint's fused-QKV gather run on GPUs too.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def on_mesh_device(t: DTensor) -> DTensor:
    """``t`` with its local shard on its mesh's device type (the same DTensor where it is already)."""
    local = t.to_local()
    if local.device.type == t.device_mesh.device_type:
        return t
    # from_local moves the shard to the mesh's device (the current one: the rank's GPU)
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full value of ``t``: a DTensor's gathered over its mesh (collective over it), from its
    mesh's device wherever its shard lies; a plain tensor as it is."""
    return on_mesh_device(t).full_tensor() if isinstance(t, DTensor) else t
