"""A rehearsal for a GPU profile saves what the GPU's kernels save (rehearse/rank.py
``_target_device_functions``): dropout's 1-byte CUDA mask, not the CPU kernel's mask in the
activation dtype; a CPU profile's plan keeps the CPU's kernels, as its real run does."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from autopar.plan import plan_from_dict

REPO = Path(__file__).resolve().parents[2]


def _plan(profile: str):
    return plan_from_dict({
        "version": 1, "model": {"file": str(REPO / "examples" / "gpt_small.py"), "num_blocks": 8},
        "cluster": {"profile": profile, "num_gpus": 1, "gpus_per_node": 1},
        "training": {"global_batch_size": 1, "micro_batch_size": 1, "seq_len": 128, "dtype": "bf16"},
        "parallel": {"dp": 1, "tp": 1, "pp": 1}})


def _saved_dtypes(ctx) -> list[torch.dtype]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved: list[torch.dtype] = []
    with FakeTensorMode():
        x = torch.empty(4, 64, dtype=torch.bfloat16, requires_grad=True)
        with ctx, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
            F.dropout(x, 0.1, True)
    return saved


def test_a_gpu_profile_rehearses_cuda_dropout() -> None:
    from autopar.rehearse.rank import _target_device_functions

    assert _saved_dtypes(_target_device_functions(_plan("h100-80g"))) == [torch.bool]


def test_a_cpu_profile_rehearses_the_cpu_kernels() -> None:
    from autopar.rehearse.rank import _target_device_functions

    assert torch.bool not in _saved_dtypes(_target_device_functions(_plan("cpu-local-2")))
