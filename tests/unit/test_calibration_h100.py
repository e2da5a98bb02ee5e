"""Issue 12: the H100/H200 profiles, their software variants, and the public H100 runs they reproduce."""

from __future__ import annotations

import pytest
import yaml

from autopar.cluster import list_profiles, load_cluster
from autopar.cost.comm import GroupLink, collective_time_s
from autopar.cost.estimate import estimate_plan
from autopar.errors import ClusterError
from autopar.reference_h100 import megatron_core_flops_per_step, public_plan, public_runs, run_graph, software_cluster

CONTRACT_NAMES = ("a100-80g", "h100-80g", "h200-141g", "cpu-local-2", "cpu-local-4")
HARDWARE = ("peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s", "memory_efficiency", "gemm",
            "kernel_overhead_s", "gpus_per_node", "intra_node", "inter_node", "attention_half_seq")


def test_contract_profile_names_load_and_variants_are_listed() -> None:
    for name in CONTRACT_NAMES:
        assert load_cluster(name).name == name
    assert {"h100-80g-megatron", "h200-141g-megatron"} <= set(list_profiles())


@pytest.mark.parametrize("gpu", ["h100-80g", "h200-141g"])
def test_megatron_variant_is_the_same_hardware_with_other_software(gpu: str) -> None:
    base, meg = load_cluster(gpu), load_cluster(f"{gpu}-megatron")
    for key in HARDWARE:
        assert getattr(base, key) == getattr(meg, key), key
    assert not base.tp_comm_overlap and meg.tp_comm_overlap
    assert not base.fused_grad_accumulation and meg.fused_grad_accumulation


def test_h200_is_h100_compute_with_its_own_memory() -> None:
    h100, h200 = load_cluster("h100-80g"), load_cluster("h200-141g")
    assert h200.peak_flops == h100.peak_flops and h200.gemm == h100.gemm
    assert h200.memory_bytes == 143_156 * 2**20 and h200.memory_bandwidth_bytes_per_s == 4.8e12
    assert h200.gpu_name == "H200-SXM-141GB"


def test_profile_base_errors_are_one_line(tmp_path) -> None:  # noqa: ANN001
    loop = tmp_path / "loop.yaml"
    loop.write_text(yaml.safe_dump({"base": str(loop)}))
    with pytest.raises(ClusterError, match="loops back"):
        load_cluster(str(loop))
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump({"base": "tpu-v9"}))
    with pytest.raises(ClusterError, match="unknown cluster profile 'tpu-v9'") as info:
        load_cluster(str(missing))
    assert "\n" not in str(info.value)


def test_public_runs_parse_with_their_published_step_times() -> None:
    runs = {r.name: r for r in public_runs()}
    assert [len(public_runs(g)) for g in ("dgxc", "megatron_core_r08", "llm_foundry", "torchtitan", "dgxc_llama31")
            ] == [4, 6, 5, 2, 7]
    assert runs["gpt3-175b-128"].step_time_s == 8.309 and runs["gpt3-175b-128"].virtual_stages == 6
    assert runs["mpt-7b-2k"].step_time_s == pytest.approx(48 * 2048 / (10643 * 8))
    # Megatron's FLOP count: 72 B s L h^2 (1 + s/6h + V/12Lh); the 1.7B row prints 408.8 TFLOP/s on 48 GPUs
    flops = megatron_core_flops_per_step(24, 2048, 4096, 131072, 192)
    assert runs["gpt-1.7b"].step_time_s == pytest.approx(flops / (408.8e12 * 48))
    n = runs["nemotron4-15b-16-tp2"]
    assert run_graph(n).num_params == pytest.approx(15.6e9, rel=0.01)  # Nemotron-4 15B, untied, GQA 8
    assert software_cluster(runs["nemotron4-340b-128"])[0].tp_comm_overlap is False  # "no TP comm overlap"
    assert software_cluster(runs["mpt-7b-2k"])[1] == "h100-80g"


def _errors(group: str) -> list[float]:
    out = []
    for run in public_runs(group):
        cluster, profile = software_cluster(run)
        est = estimate_plan(public_plan(run, profile), run_graph(run), cluster)
        out.append(abs(est.step_time_s / run.step_time_s - 1))
    return out


def test_dgxc_and_megatron_core_rows_within_5_percent_mean_10_max() -> None:
    """Priced from kernel tables (profiles/kernels/), Megatron's element-wise work as its fused
    kernels move it (autopar.cost.fused_elementwise) and three fitted terms."""
    errors = _errors("dgxc") + _errors("megatron_core_r08")
    assert sum(errors) / len(errors) <= 0.05 and max(errors) <= 0.10, [f"{e:.1%}" for e in errors]


def test_dgxc_llama31_context_parallel_rows_within_5_percent_mean() -> None:
    """NVIDIA's Llama 3.1 8B / 70B / 405B recipes, all at context parallelism 2 (7 runs): priced
    with the eager model file's element-wise ops they were 8-44 % slow (the 8B worst: an fp32
    RMSNorm, RoPE and SwiGLU written as some 40 kernels where TE runs 6). The 8B at tp 1 is still
    +7-8 %."""
    errors = _errors("dgxc_llama31")
    assert sum(errors) / len(errors) <= 0.05 and max(errors) <= 0.10, [f"{e:.1%}" for e in errors]


def test_torchtitan_llama_8k_rows_never_fitted_level() -> None:
    """Llama 3.1 8B at 8k tokens under FSDP2 (torchtitan's published runs on Grand Teton: a 500 W
    H100 with 96 GB of HBM2e, never fitted). Priced on h100-80g they are 11-12 % slow: the eager
    element-wise share the DGX H100 sources fit (0.24) prices this per-op-recompute Llama's eager
    norms and rotations above what that run spent. This guards the level, not a target."""
    errors = _errors("torchtitan")
    assert max(errors) <= 0.15, [f"{e:.1%}" for e in errors]


def test_llm_foundry_fsdp_rows_within_10_percent_mean() -> None:
    errors = _errors("llm_foundry")
    assert sum(errors) / len(errors) <= 0.10, [f"{e:.1%}" for e in errors]


def test_large_groups_pay_latency_that_grows_with_the_ring() -> None:
    """FSDP at dp >= 512 is priced, not free: an all-gather's latency grows with the ring (n - 1 hops);
    an all-reduce across nodes takes NCCL's tree where the ring's 2 (n - 1) hops would cost more."""
    h100 = load_cluster("h100-80g")

    def group(n: int) -> GroupLink:
        return GroupLink(size=n, members_per_node=8, intra_node=False,
                         bandwidth_bytes_per_s=h100.intra_node.bandwidth_bytes_per_s, link=h100.inter_node)

    small = 8e6  # one block's share: latency-bound at this scale
    ag = [collective_time_s("all_gather", small, group(n)) for n in (64, 512, 4096)]
    assert ag[0] < ag[1] < ag[2] and ag[2] > 4095 * h100.inter_node.latency_s
    ring_hops = 2 * 511 * h100.inter_node.latency_s
    assert collective_time_s("all_reduce", small, group(512)) < ring_hops  # the tree, not the ring
