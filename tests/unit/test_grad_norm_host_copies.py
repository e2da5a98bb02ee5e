"""(GPU readiness, M15) the gradient noise scale's squared norms are summed on the device without a
host list copied there: ``_sq_norms`` runs in every FSDP2 group's post-backward and on every DDP
bucket, and ``torch.tensor(weights, device=cuda)`` would drain the stream each time, stalling the
backward being measured. On the CPU the copy costs nothing, so the test asserts no tensor is made
from host data with a device named, and that the weighted sum is unchanged."""

from __future__ import annotations

import torch

from autopar.executor.runtime import grad_norms


def test_weighted_squared_norms_copy_no_host_list_to_the_device(monkeypatch) -> None:
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7, dtype=torch.bfloat16), torch.randn(2, 2), torch.randn(4)]
    weights = [0.5, 1.0, 0.5, 2.0]
    want = sum(w * float(g.float().norm()) ** 2 for g, w in zip(grads, weights))
    made: list[object] = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda data, *a, **kw: (made.append(kw.get("device")), real(data, *a, **kw))[1])
    got = grad_norms._sq_norms(grads, weights, torch.device("cpu"))
    assert [d for d in made if d is not None] == []  # nothing built on the host and sent to the device
    assert got.dtype == torch.float64 and abs(float(got) - want) < 1e-3 * want
    assert float(grad_norms._sq_norms([], [], torch.device("cpu"))) == 0.0
