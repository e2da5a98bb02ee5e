"""What would break on a GPU, guarded on CPU: fp16 without loss scaling is refused before any rank
starts; a rank's out-of-memory ends in one line (tests/dist/test_fault_cli.py runs it end to end)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.errors import EXIT_OUT_OF_MEMORY, AutoparError, OutOfDeviceMemory
from autopar.executor.runtime.checks import preflight
from autopar.executor.runtime.rank_main import out_of_memory
from autopar.modelfile import load_model_file
from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training

SMALL = Path(__file__).resolve().parents[2] / "examples" / "gpt_small.py"


def _plan(dtype: str, pp: int = 1, prediction: dict | None = None) -> Plan:
    return Plan(model=ModelRef(file=str(SMALL), num_blocks=8), cluster=ClusterRef(profile="cpu-local-2", num_gpus=pp,
                                                                                gpus_per_node=8),
                training=Training(global_batch_size=8, micro_batch_size=1, seq_len=128, dtype=dtype, optimizer="adam"),
                parallel=Parallel(dp=1, tp=1, pp=pp), prediction=prediction)


@pytest.mark.parametrize("pp", [1, 2])
def test_fp16_is_refused_at_every_pipeline_depth(pp: int) -> None:
    with pytest.raises(AutoparError, match="fp16 needs loss scaling"):
        preflight(_plan("fp16", pp), load_model_file(SMALL), pp)
    preflight(_plan("bf16", pp), load_model_file(SMALL), pp)  # bf16 is fine


def test_out_of_memory_line_names_the_rank_the_step_and_the_priced_peak() -> None:
    plan = _plan("bf16", prediction={"peak_memory_bytes": 78 * 2**30, "capacity_bytes": 79.18 * 2**30})
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")
    err = out_of_memory(3, "step 7", exc, plan, "plans/p.yaml")
    assert isinstance(err, OutOfDeviceMemory) and err.exit_code == EXIT_OUT_OF_MEMORY == 3
    line = str(err)
    assert "rank 3 ran out of device memory in step 7 (CUDA out of memory. Tried to allocate 2.00 GiB)" in line
    assert "priced at 78.0 of 79.2 GiB" in line and "autopar rehearse plans/p.yaml" in line and "\n" not in line


def test_a_rank_without_a_gpu_is_one_line(monkeypatch) -> None:
    """Two ranks on a host showing one GPU: the second rank's device is a one-line error naming the
    count and the fix, not CUDA's invalid-ordinal traceback; --device cpu keeps it on the CPU."""
    from autopar.executor.parallel import mesh

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(mesh.DEVICE_ENV, "auto")
    with pytest.raises(AutoparError, match="local rank 1 has no GPU: this host shows 1 CUDA device"):
        mesh.device_for_rank()
    monkeypatch.setenv(mesh.DEVICE_ENV, "cpu")
    assert mesh.device_for_rank().type == "cpu" and mesh.chosen_device_type() == "cpu"


def test_run_checks_the_gpus_before_starting_ranks(monkeypatch) -> None:
    from autopar.commands.run import set_device_choice
    from autopar.executor.parallel.mesh import DEVICE_ENV

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(AutoparError, match="--nproc-per-node 4 needs 4 GPUs .* this host shows 2"):
        set_device_choice("auto", 4)
    set_device_choice("cpu", 4)  # fine on the CPU
    import os

    assert os.environ[DEVICE_ENV] == "cpu"


def test_an_older_torch_is_one_line_naming_what_it_lacks(monkeypatch) -> None:
    """torch >= 2.6 plans; the executor calls APIs of later builds: a torch without them is refused
    before any rank starts, naming what is missing."""
    from torch.distributed.fsdp import FSDPModule

    from autopar.executor.runtime import checks

    assert checks.torch_support_reason() is None  # the torch the suite runs on has them
    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    reason = checks.torch_support_reason()
    assert reason is not None and "FSDPModule.set_force_sum_reduction_for_comms" in reason and ">= 2.10" in reason
    with pytest.raises(AutoparError, match="autopar run needs torch >= 2.10"):
        preflight(_plan("bf16"), load_model_file(SMALL), 1)


def test_tied_gradients_on_the_host_are_reduced_on_the_device_under_nccl(monkeypatch) -> None:
    """Parameter offload keeps gradients on the CPU; NCCL takes device tensors only: the tied-weight
    sum goes through a device copy (here the device is faked: the copy and the collective are
    recorded)."""
    from autopar.executor.parallel import pipeline_parallel as pipe

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pipe.dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device: (seen.append(("to", str(device))), self * 1)[1])
    monkeypatch.setattr(pipe.dist, "all_reduce", lambda t, group: (seen.append(("all_reduce", t.device.type)), t.mul_(2)))
    grad = torch.ones(3)
    pipe.all_reduce_on_group_device(grad, object())
    assert seen == [("to", "cuda:0"), ("all_reduce", "cpu")] and grad.tolist() == [2.0, 2.0, 2.0]


def test_pinned_host_buffers_are_not_rounded_up_to_powers_of_two(monkeypatch) -> None:
    """Host offload pins each buffer through CUDA's caching host allocator, which rounds it up to a
    power of two (up to 2x the priced host memory): a GPU rank caps that rounding, unless the user
    configured the allocator's pinned settings."""
    from autopar.executor.parallel import mesh

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(mesh.DEVICE_ENV, "cuda")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert mesh.device_for_rank() == torch.device("cuda", 0)
    assert calls == [f"pinned_max_round_threshold_mb:{mesh.PINNED_ROUND_MB}"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_max_round_threshold_mb:1024")
    calls.clear()
    mesh.device_for_rank()
    assert calls == []  # the user's own setting stands


def test_fp32_plans_on_a_gpu_are_priced_at_tf32_and_run_on_it(monkeypatch) -> None:
    """An fp32 plan on a datasheet GPU profile is priced at its TF32 peak (half the bf16 one), not
    the bf16 peak; a GPU rank runs fp32 matmuls on TF32 tensor cores (precision "high"), as priced."""
    from autopar.cluster import load_cluster
    from autopar.executor.parallel import mesh
    from autopar.profile_conditions import RunConditions, price_for_run

    h100 = load_cluster("h100-80g")
    fp32 = price_for_run(h100, RunConditions(dtype="fp32", ranks_on_host=8), profile_label="h100-80g").cluster
    bf16 = price_for_run(h100, RunConditions(dtype="bf16", ranks_on_host=8), profile_label="h100-80g").cluster
    assert fp32.peak_flops == 494.7e12 and bf16.peak_flops == 989.4e12
    a100 = load_cluster("a100-80g")
    assert price_for_run(a100, RunConditions(dtype="fp32", ranks_on_host=8), profile_label="a100-80g").cluster.peak_flops == 156e12

    precision: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", precision.append)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(mesh.DEVICE_ENV, "cuda")
    mesh.device_for_rank()
    assert precision == ["high"]
