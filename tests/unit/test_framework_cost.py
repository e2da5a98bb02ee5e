"""Issue 18: FSDP2's and DTensor's time per parameter tensor (autopar.cost.framework), priced from a
profile's ``measured.comm.fsdp`` figures, and zero where a profile did not measure them."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster import cluster_from_dict, load_cluster
from autopar.cost.comm import axis_link, collective_time_s
from autopar.cost.framework import dp_wrapper, has_dtensor_params
from autopar.cost.stage import Config, build_terms
from autopar.cost.step import evaluate
from autopar.errors import ClusterError
from autopar.layout import Layout
from autopar.profile_conditions import RunConditions, price_for_run

G, R, O = 3e-4, 5e-4, 7e-4  # seconds per tensor: gather, reduce, optimizer


def cfg(**changes) -> Config:
    fields = dict(dp=4, tp=1, pp=1, cp=1, cp_kind="ring", sequence_parallel=False, zero=1, recompute="none",
                  schedule="1f1b", virtual_stages=1, micro_batch=1, global_batch=16, seq_len=1024, dtype_bytes=2,
                  optimizer="adam")
    fields.update(changes)
    return Config(**fields)


@pytest.fixture(scope="module")
def measured():
    return dataclasses.replace(load_cluster("a100-80g"), fsdp_gather_s_per_tensor=G, fsdp_reduce_s_per_tensor=R,
                               dtensor_optimizer_s_per_tensor=O)


def _tensors(graph) -> int:
    return sum(graph.params[r].tensors * (graph.num_blocks if r == "block" else 1) for r in ("pre", "block", "post", "loss"))


def test_the_graph_counts_parameter_tensors(small_gpt) -> None:
    # A GPT block: two layer norms (weight, bias), qkv, proj, fc1, fc2 (weight, bias each) = 12.
    assert small_gpt.params["block"].tensors == 12
    assert small_gpt.params["pre"].tensors >= 1 and _tensors(small_gpt) > 16 * 12


@pytest.mark.parametrize("changes,wrapper", [
    (dict(zero=0), "ddp"), (dict(zero=0, tp=2), "replicate"), (dict(zero=0, pp=2), "replicate"),
    (dict(zero=1), "fully_shard"), (dict(zero=1, dp=1), "none"), (dict(zero=3, dp=1), "fully_shard"),
    (dict(zero=0, dp=1), "none"), (dict(zero=2), "fully_shard"),
    # one data-parallel rank with DTensor parameters or a pipeline: replicate for its mixed precision
    # (unwrapped, autocast kept a weight copy per micro-batch in flight)
    (dict(zero=0, dp=1, tp=2), "replicate"), (dict(zero=1, dp=1, pp=2), "replicate"),
])
def test_the_wrapper_is_the_one_the_executor_applies(changes, wrapper) -> None:
    from autopar.executor.parallel.data_parallel import wrap_kind

    c = cfg(**changes)
    assert dp_wrapper(c) == wrapper
    assert has_dtensor_params(c) == (wrapper in ("fully_shard", "replicate") or changes.get("tp", 1) > 1)
    executed = wrap_kind(c.zero, c.dp * c.cp, replicated=c.tp > 1 or c.pp > 1)
    assert {"fsdp": "fully_shard"}.get(executed, executed) == wrapper


def test_a_profile_without_the_figures_prices_nothing_new(small_gpt, a100) -> None:
    for z in (0, 1, 2, 3):
        assert build_terms(small_gpt, a100, cfg(zero=z)).framework_s_per_param == 0.0


def test_zero1_pays_gather_reduce_and_optimizer_per_tensor_once_a_step(small_gpt, a100, measured) -> None:
    c = cfg(zero=1)
    base, priced = build_terms(small_gpt, a100, c), build_terms(small_gpt, measured, c)
    params = small_gpt.num_blocks * base.block.params + base.pre.params + base.post.params
    link = axis_link(measured, Layout.of(c), "dp_cp")
    units = small_gpt.num_blocks + 1  # every block a fully_shard unit, and the root
    per_unit = collective_time_s("reduce_scatter", 1.0, link) + collective_time_s("all_gather", 1.0, link)
    expected = (G + R + O) * _tensors(small_gpt) + units * per_unit
    step_base = evaluate(base, [small_gpt.num_blocks], 1.0, 1.0, a100.peak_flops).step_time_s
    step = evaluate(priced, [small_gpt.num_blocks], 1.0, 1.0, measured.peak_flops).step_time_s
    assert priced.framework_s_per_param * params == pytest.approx(expected)
    assert step - step_base == pytest.approx(expected)
    assert priced.block == base.block  # nothing per micro-batch at ZeRO-1


def test_zero3_pays_per_micro_batch_and_ddp_only_nothing(small_gpt, a100, measured) -> None:
    base, priced = build_terms(small_gpt, a100, cfg(zero=3)), build_terms(small_gpt, measured, cfg(zero=3))
    t = small_gpt.params["block"].tensors
    # forward gathers, backward gathers again and reduce-scatters: (2 G + R) per tensor per micro-batch
    assert priced.block.time_s - base.block.time_s == pytest.approx((2 * G + R) * t)
    assert priced.framework_s_per_param > 0  # the DTensor optimizer step
    ddp = build_terms(small_gpt, measured, cfg(zero=0))
    assert ddp.framework_s_per_param == 0.0 and ddp.block == build_terms(small_gpt, a100, cfg(zero=0)).block


def test_the_split_ilp_sees_the_framework_time(small_gpt, measured) -> None:
    """The tail coefficient the ILP and the capped bound read includes it (one property)."""
    from autopar.search.ilp import solve_split

    terms = build_terms(small_gpt, measured, cfg(zero=1, pp=2, dp=2))
    assert terms.after_sync_s_per_param == pytest.approx(
        terms.param_gather_s_per_param + terms.optimizer_s_per_param + terms.framework_s_per_param)
    sol = solve_split(terms, small_gpt.num_blocks, method="enumeration")
    est = evaluate(terms, list(sol.chunk_blocks), 1.0, 1.0, measured.peak_flops)
    assert sol.objective_s == pytest.approx(est.step_time_s, rel=1e-3)


def _profile(fsdp: dict) -> dict:
    base = {"name": "p", "gpu": {"name": "cpu", "peak_flops": 1e11, "memory_bytes": 8e9,
                                 "memory_bandwidth_bytes_per_s": 1e10, "framework_reserve_bytes": 1e8},
            "network": {"gpus_per_node": 2, "intra_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4},
                        "inter_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}},
            "efficiency": {"memory": 0.5, "attention": 0.5, "kernel_overhead_s": 1e-5, "gemm_max": 0.5,
                           "gemm_half_dim": 64},
            "measured": {"device": {"type": "cpu", "cores": 2, "concurrent_ranks": 2, "threads": 1},
                         "comm": {"ranks": 2, "link": "intra_node", "rendezvous_s": 1e-4, "collectives": {
                             "all_reduce": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}}, "fsdp": fsdp}}}
    return base


def test_the_profile_section_loads_checks_and_scales_with_ranks() -> None:
    cluster = cluster_from_dict(_profile({"gather_s_per_tensor": G, "reduce_s_per_tensor": R,
                                          "optimizer_s_per_tensor": O, "tensors": 34, "units": 5}), "p")
    assert (cluster.fsdp_gather_s_per_tensor, cluster.fsdp_reduce_s_per_tensor,
            cluster.dtensor_optimizer_s_per_tensor) == (G, R, O)
    with pytest.raises(ClusterError, match="unknown key 'gather'"):
        cluster_from_dict(_profile({"gather": G}), "p")
    with pytest.raises(ClusterError, match="must be >= 0"):
        cluster_from_dict(_profile({"reduce_s_per_tensor": -1.0}), "p")
    # 4 single-threaded ranks on the 2 cores the 2 measuring ranks had: CPU time doubles (core share)
    priced = price_for_run(cluster, RunConditions(dtype="fp32", ranks_on_host=4), profile_label="p.yaml").cluster
    assert priced.fsdp_reduce_s_per_tensor == pytest.approx(2 * R)
    assert priced.dtensor_optimizer_s_per_tensor == pytest.approx(2 * O)
