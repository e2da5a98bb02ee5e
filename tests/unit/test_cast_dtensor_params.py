"""Optimizer offload holds device parameters in the training dtype (data_parallel._cast_parameters):
a tensor-parallel (DTensor) parameter's local shard must be cast too -- assigning ``.data`` changed
the dtype the DTensor reported but left its shard fp32, which FSDP2 shards from (every tp-sharded
weight stayed fp32 on the device, and a vocabulary-parallel embedding beside bf16 root parameters
made FSDP2 refuse the group)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def test_a_dtensor_parameter_is_cast_with_its_shard() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.executor.parallel.data_parallel import _cast_parameters

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        m = nn.Module()
        m.w = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        m.b = nn.Parameter(torch.randn(3))
        tied = m.w
        _cast_parameters(m, torch.bfloat16, lambda p: True)
        assert m.w is tied  # the same Parameter object: ties survive
        assert m.w.dtype == m.w.to_local().dtype == m.b.dtype == torch.bfloat16
        assert m.w.to_local().shape == (2, 3) and m.w.placements == (Shard(0),)
    finally:
        dist.destroy_process_group()
