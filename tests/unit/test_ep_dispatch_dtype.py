"""Under autocast the expert-parallel exchange sends its rows in the autocast dtype (the bytes the
cost model prices), and gives back the caller's dtype (GPU readiness: fp32 rows were twice the
priced all-to-all volume wherever fp32 parameters train under autocast)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.executor.parallel import expert_exchange as exchange_mod
from autopar.executor.parallel import expert_parallel as ep_mod


def test_rows_travel_in_the_autocast_dtype(monkeypatch) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.executor.parallel.expert_parallel import ExpertGroups

    sent: list[torch.dtype] = []
    monkeypatch.setattr(exchange_mod, "_a2a", lambda x, out_s, in_s, group: (sent.append(x.dtype), x.clone())[1])
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, inp, group=None: out.copy_(inp))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("pp", "edp", "ep", "tp"))
        groups = ExpertGroups(mesh=mesh, ep=1, edp=1, num_experts=2, grad_divide=1)
        rows, counts = torch.randn(4, 8), torch.tensor([2, 2])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ep_mod.exchange(rows, counts, groups, lambda x, per: x * 2)
        assert sent == [torch.bfloat16, torch.bfloat16] and out.dtype == torch.float32
        torch.testing.assert_close(out, (rows.bfloat16() * 2).float())
        sent.clear()
        out = ep_mod.exchange(rows, counts, groups, lambda x, per: x * 2)  # no autocast: as given
        assert sent == [torch.float32, torch.float32] and torch.equal(out, rows * 2)
    finally:
        dist.destroy_process_group()


def test_experts_shard_evenly_over_their_edp_ranks() -> None:
    """FSDP2 shards dim 0 by default: a rank's one stacked expert (Mixtral at ep 8) over 4 edp ranks
    left the whole expert and its optimizer states on the first (rehearsed 113 GiB, priced 74)."""
    from torch import nn
    from torch.distributed.tensor import Shard

    place = ep_mod._even_shard(4)
    assert place(nn.Parameter(torch.empty(8, 6, 4))) is None  # 8 experts: FSDP2's Shard(0)
    assert place(nn.Parameter(torch.empty(1, 28672, 4096))) == Shard(1)  # the largest dim that divides
    assert place(nn.Parameter(torch.empty(1, 4096, 14336))) == Shard(2)
    assert place(nn.Parameter(torch.empty(1, 3))) is None  # nothing divides: FSDP2 pads dim 0
