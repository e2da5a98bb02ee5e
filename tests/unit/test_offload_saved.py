"""Activation offload copies activations as the device holds them (GPU readiness, M8): not weights: ``nn.Linear`` saves a
transposed view of its weight for backward, which is no ``nn.Parameter`` but shares its storage;
copying it to the host per micro-batch moved every block weight over PCIe on top of the priced
activations (cost/offload.py prices the block's saved activations only); and a storage saved
through several views (softmax's output and the matmul's view of it) once, not once per view."""

from __future__ import annotations

import torch
from torch import nn

from autopar.executor.parallel.offload import OffloadSavedTensors


def _host_bytes(model: nn.Module, x: torch.Tensor, autocast: bool = False) -> int:
    before = OffloadSavedTensors.host_bytes
    with OffloadSavedTensors(pin_memory=False), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().sum().backward()
    return OffloadSavedTensors.host_bytes - before


def test_linear_weights_stay_on_the_device() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    # saved: x (4x8) for the first weight's gradient, and ReLU's output (4x16), which is also the
    # second Linear's input: one tensor on the device, copied once
    assert _host_bytes(model, x) == 4 * (4 * 8 + 4 * 16)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref.load_state_dict(model.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)  # the weights came back as they were
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


def test_autocast_weight_copies_are_offloaded_as_priced() -> None:
    # under autocast each Linear saves a 16-bit copy of its weight per micro-batch: a tensor of its
    # own (cost/stage.py prices it with the block's activations), so it goes to the host
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    got = _host_bytes(model, torch.randn(4, 8, requires_grad=True), autocast=True)
    weights = 2 * (8 * 16 + 16 * 8)
    assert got >= weights + 2 * (4 * 8 + 4 * 16)


def test_host_optimizer_threads_on_a_gpu_rank() -> None:
    # the CPU Adam of optimizer offload gets the rank's share of the node's cores on a GPU rank
    # (ranks start with OMP_NUM_THREADS=1); a CPU rank keeps what rank_main gave it
    from autopar.executor.parallel.offload import host_step_threads

    assert host_step_threads(torch.device("cuda", 3), 96, 8) == 12
    assert host_step_threads(torch.device("cuda", 0), 4, 8) == 1
    assert host_step_threads(torch.device("cpu"), 96, 8) is None


class _Attention(nn.Module):
    """Softmax saves its output; the matmul after it saves a reshaped view of the same storage."""

    def forward(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(q @ q.transpose(-1, -2), dim=-1)  # (b, h, s, s)
        b, h, s, _ = p.shape
        return torch.bmm(p.reshape(b * h, s, s), v.reshape(b * h, s, -1)).reshape(b, h, s, -1)


def test_views_of_one_storage_are_copied_once_and_come_back_right() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 3, 16, 8, requires_grad=True)
    v = torch.randn(2, 3, 16, 8, requires_grad=True)
    q2, v2 = (t.detach().clone().requires_grad_() for t in (q, v))
    before = OffloadSavedTensors.host_bytes
    with OffloadSavedTensors(pin_memory=False):
        out = _Attention()(q, v)
    out.pow(2).sum().backward()
    host = OffloadSavedTensors.host_bytes - before
    _Attention()(q2, v2).pow(2).sum().backward()
    assert torch.allclose(q.grad, q2.grad) and torch.allclose(v.grad, v2.grad)
    scores = 2 * 3 * 16 * 16 * 4  # once, though softmax and bmm both save it
    # q (the first matmul saves it and its transposed view: one storage), the scores, v
    assert host == 2 * 3 * 16 * 8 * 4 + scores + 2 * 3 * 16 * 8 * 4
