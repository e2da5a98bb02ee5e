"""ZeRO-3 under a pipeline keeps its per-micro-batch reduce-scatter and resharding
(executor/parallel/data_parallel.py ``sync_every_microbatch``): torch.distributed.pipelining's stage switches
both off before every backward, which would hold the stage's whole fp32 gradients and gathered
parameters (ZeRO-1's memory); on a ZeRO-3 stage module the switches are no-ops."""

from __future__ import annotations

import torch
from torch import nn


def _groups(module: nn.Module) -> list:
    from torch.distributed.fsdp import fully_shard

    return list(fully_shard.state(module)._fsdp_param_groups)  # noqa: SLF001


def test_a_zero3_stage_module_ignores_the_pipeline_switches() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from autopar.executor.parallel.data_parallel import sync_every_microbatch
    from autopar.rehearse.fake import fake_rank

    with fake_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        plain, zero3 = nn.Linear(8, 8), nn.Linear(8, 8)
        fully_shard(plain, mesh=mesh)
        fully_shard(zero3, mesh=mesh)
        sync_every_microbatch(zero3)
        for m in (plain, zero3):  # what PipelineStage.backward_maybe_with_nosync does
            m.set_reshard_after_backward(False)
            m.set_requires_gradient_sync(False)
        assert all(not g.reduce_grads and not g.reshard_after_backward for g in _groups(plain))
        assert all(g.reduce_grads and g.reshard_after_backward for g in _groups(zero3))


def test_build_schedule_applies_it_to_zero3_plans_only(monkeypatch) -> None:
    import autopar.executor.parallel.data_parallel as dp_mod
    from autopar.executor.parallel import pipeline_parallel as pipe

    seen: list[int] = []
    monkeypatch.setattr(dp_mod, "sync_every_microbatch", lambda m: seen.append(id(m)))

    class _Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr("torch.distributed.pipelining.PipelineStage", stop)
    for zero, expected in ((3, 1), (1, 0)):
        seen.clear()
        plan = type("P", (), {})()
        plan.parallel = type("Par", (), {"zero": zero, "num_stage_chunks": 2, "pp_schedule": "1f1b"})()
        try:
            pipe.build_schedule(plan, [nn.Linear(2, 2)], [0], None, torch.device("cpu"), lambda o, t: o)
        except _Stop:
            pass
        assert len(seen) == expected
