"""What `autopar validate` reports as a CUDA rank's peak (torch.cuda mocked: the CPU suite has no GPU):
the device use at the caching allocator's peak -- its peak reservation plus what lives outside it
(CUDA context, NCCL buffers) -- beside the tensor peak, so the profile's reserve is measured."""

from __future__ import annotations

import torch

from autopar.executor.runtime import train


def test_device_peak_adds_what_lives_outside_the_allocator(monkeypatch) -> None:
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))  # 50 GiB used now
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 46 * gib)  # 4 GiB outside torch
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 70 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 66 * gib)
    allocated, device_peak = train.cuda_device_peak_bytes(torch.device("cuda", 0))
    assert allocated == 66 * gib
    assert device_peak == 74 * gib  # the allocator's 70 GiB peak reservation + 4 GiB of context and NCCL


def test_a_host_build_that_cannot_fit_is_one_line() -> None:
    import pytest

    from autopar.errors import AutoparError
    from autopar.executor.runtime.checks import check_host_build

    with torch.device("meta"):
        model = torch.nn.Linear(1024, 1024)  # 4 MiB of fp32 parameters
    check_host_build(model, 2, 9 * 2**20)  # the built model and the shared file: 2 x 4 MiB fits 9 MiB
    check_host_build(model, 2, None)  # unknown: no check
    with pytest.raises(AutoparError, match="holds 2 copies of the model .*start one rank per node$"):
        check_host_build(model, 2, 6 * 2**20)
    with pytest.raises(AutoparError, match="holds the model: .*use nodes with more host memory$"):
        check_host_build(model, 1, 2 * 2**20)
