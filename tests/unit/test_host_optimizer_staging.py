"""(GPU readiness, M17) the optimizer offload moves a device parameter held in the training dtype
(bf16 beside fp32 host masters) in that dtype, through a host buffer of it: no copy between the
device's tensors and the host's converts the dtype on the way. Across a GPU link such a copy
converts on the GPU when non-blocking -- the upload carried fp32, twice the priced bytes, through a
device temporary -- and through an unpinned host temporary when blocking (the download). On CPU
ranks the "device" tensors are the parameters and their gradients; every copy that touches one is
recorded."""

from __future__ import annotations

import torch
from torch import nn

from autopar.executor.parallel.offload import HostOptimizer


def test_bf16_parameters_cross_in_bf16_and_step_like_fp32_adamw(monkeypatch) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(8, 4)
    model = nn.Linear(8, 4)
    model.load_state_dict(ref.state_dict())
    model.to(torch.bfloat16)
    opt = HostOptimizer(model.parameters(), lambda ms: torch.optim.AdamW(ms, lr=1e-2), pin_memory=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    device_side = {t.data_ptr() for t in model.parameters()}
    converting: list[tuple[torch.dtype, torch.dtype]] = []
    real_copy = torch.Tensor.copy_

    def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        touches = dst.data_ptr() in device_side or src.data_ptr() in device_side
        if touches and dst.dtype != src.dtype:
            converting.append((src.dtype, dst.dtype))
        return real_copy(dst, src, non_blocking)

    for step in range(2):
        x = torch.randn(3, 8)
        model(x.bfloat16()).float().square().sum().backward()
        ref(x).square().sum().backward()
        device_side |= {p.grad.data_ptr() for p in model.parameters()}
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        opt.step()
        monkeypatch.undo()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert converting == []  # every copy over the link was bf16 to bf16
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.float(), r.detach(), atol=2e-2, rtol=2e-2)  # bf16 gradients, bf16 storage
