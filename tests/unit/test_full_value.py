"""(GPU readiness, B15) a DTensor whose shard lives on the host -- FSDP2's CPU offload, the optimizer
offload's masters -- is gathered from its mesh's device: NCCL takes no host tensors, so
``full_parameters`` (``--grad-norms``, the equivalence harness under NCCL) failed at ZeRO-3 with
parameter offload on GPUs. On CPU ranks shard and mesh share the host, so the mesh's device type is
made to differ here, and ``full_tensor`` records the device of the shard it would gather."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from autopar.executor.parallel.full_value import full_tensor


@pytest.fixture
def mesh():  # noqa: ANN201
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_host_shard_is_gathered_on_the_mesh_device(monkeypatch, mesh) -> None:  # noqa: ANN001
    t = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    gathered: list[str] = []
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: (gathered.append(self.to_local().device.type),
                                                                     self.to_local())[1])
    assert torch.equal(full_tensor(t), torch.arange(4.0))
    assert gathered == ["cpu"]  # shard and mesh on the host: gathered as it is
    with monkeypatch.context() as m:  # a GPU mesh over a host shard, as FSDP2's CPU offload
        m.setattr(type(mesh), "device_type", property(lambda self: "meta"))
        out = full_tensor(t)
    assert gathered == ["cpu", "meta"] and out.shape == (4,)  # moved to the mesh's device before the gather


def test_plain_tensors_pass_through() -> None:
    x = torch.ones(3)
    assert full_tensor(x) is x
