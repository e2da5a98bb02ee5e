"""Issue 14: CPU and activation offload -- the plan key, the host figures of the cluster profile, the
cost formulas of autopar/cost/offload.py, the host-memory constraint and the no-plan-fits message."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster import cluster_from_dict, load_cluster
from autopar.cost.comm import axis_link, collective_time_s
from autopar.cost.framework import grad_reduce_bytes
from autopar.cost.host import evaluate_with_host, host_per_node
from autopar.cost.memory import inflight_microbatches, state_bytes_per_param
from autopar.cost.stage import Config, build_terms
from autopar.errors import ClusterError, InfeasibleError, PlanError
from autopar.layout import Layout
from autopar.plan import NO_OFFLOAD, Offload, dump_plan, parse_plan
from autopar.search.search import search
from autopar.search.space import SearchSpace


def cfg(**changes) -> Config:
    fields = dict(dp=4, tp=2, pp=1, cp=1, cp_kind="ring", sequence_parallel=True, zero=1, recompute="none",
                  schedule="1f1b", virtual_stages=1, micro_batch=1, global_batch=16, seq_len=1024, dtype_bytes=2,
                  optimizer="adam")
    fields.update(changes)
    return Config(**fields)


def both(graph, cluster, **changes):
    c = cfg(**changes)
    return build_terms(graph, cluster, dataclasses.replace(c, offload=NO_OFFLOAD)), build_terms(graph, cluster, c)


def test_optimizer_offload_moves_the_states_and_prices_copies_and_the_cpu_step(small_gpt, a100) -> None:
    base, off = both(small_gpt, a100, offload=Offload(optimizer=True))
    n, d, bw = 4, 2, a100.host_link_bandwidth_bytes_per_s
    rate = a100.cpu_optimizer_params_per_s / 8  # this node's 8 GPUs share the host's CPU Adam
    # GPU: no optimizer states, the parameter shard stored in bf16 beside FSDP2's gathered copy;
    # host: K / N = 12 / 4 bytes per parameter (ZeRO-1)
    assert off.state_split["optimizer"] == 0.0 and base.state_split["optimizer"] == pytest.approx(12 / n)
    assert off.state_split["params"] == pytest.approx(base.state_split["params"] + d / n)
    assert off.state_bytes_per_param == pytest.approx(base.state_bytes_per_param - 12 / n + d / n)
    assert off.offload.host_state_bytes_per_param == pytest.approx(12 / n)
    # tail per parameter: gradient shard down + updated shard up + CPU Adam, one after the other
    assert off.optimizer_s_per_param == pytest.approx((1 / n) * (2 * d / bw + 1 / rate))
    assert off.block == base.block and off.grad_sync_s_per_param == base.grad_sync_s_per_param


@pytest.mark.parametrize("changes,stored", [
    (dict(dp=1, tp=2, zero=0), 2.0),  # replicate over one rank: the whole parameter stored in bf16
    (dict(dp=2, tp=1, pp=2, zero=0), 2.0),  # replicate, a pipeline stage
    (dict(dp=4, zero=2), 2.0 / 4),  # fully_shard keeps the gathered copy through the step: the shard more
    (dict(dp=4, zero=3), 0.0),  # ZeRO-3's params are the shard already
    (dict(dp=4, tp=1, zero=0), 0.0),  # DDP: the fp32 parameters themselves, no second copy
])
def test_optimizer_offload_keeps_the_stored_parameters_fsdp2_gathers_from(small_gpt, a100, changes, stored) -> None:
    """Under optimizer offload the executor stores FSDP2's parameters in the training dtype and
    FSDP2 gathers a separate compute copy from them (rehearsed: GPT-3 at dp 1 tp 8 pp 8, 5.26 GiB
    stored beside 5.06 GiB gathered on the first stage)."""
    base, off = both(small_gpt, a100, offload=Offload(optimizer=True), **changes)
    c = cfg(**changes)
    formula = state_bytes_per_param(zero=c.zero, shard_degree=c.dp * c.cp, dtype_bytes=2, optimizer="adam")
    # the ZeRO formula's 16-bit parameters plus the stored copy; not FSDP2's fp32 shards (the host has the masters)
    assert off.state_split["params"] == pytest.approx(formula.params + stored)
    assert off.offload.host_state_bytes_per_param == pytest.approx(formula.optimizer)


def test_params_offload_is_fsdp2_at_zero3_and_extends_each_gather_by_the_host_copy(small_gpt, a100) -> None:
    full = Offload(optimizer=True, params=True, grads=True)
    base, off = both(small_gpt, a100, zero=3, offload=full)
    n, d, bw = 4, 2, a100.host_link_bandwidth_bytes_per_s
    assert off.state_bytes_per_param == 0.0 and set(off.state_split.values()) == {0.0}
    assert off.offload.host_state_bytes_per_param == pytest.approx((2 + 2 + 12) / n)
    assert off.optimizer_s_per_param == pytest.approx((1 / n) / (a100.cpu_optimizer_params_per_s / 8))
    assert off.transient_bytes == base.transient_bytes  # the gathered block still lives on the GPU
    # exposure = overlapped(ag + h, fwd) + overlapped(ag + h + rs + h, bwd), h = P d / N / B
    link = axis_link(a100, Layout.of(off.config), "dp_cp")
    b = base.block
    h = b.params * d / n / bw
    ag = collective_time_s("all_gather", b.params * d, link) + h
    rs = collective_time_s("reduce_scatter", b.params * grad_reduce_bytes(off.config, a100), link) + h  # fp32 reduce
    c = a100.overlap_cost_fraction
    bwd = b.bwd_s - b.zero_comm_s
    want = max(0.0, ag - b.fwd_s) + c * min(ag, b.fwd_s) + max(0.0, ag + rs - bwd) + c * min(ag + rs, bwd)
    assert off.block.zero_comm_s == pytest.approx(want) and off.block.zero_comm_s > b.zero_comm_s
    assert off.block.bwd_s == pytest.approx(bwd + want)


def test_activation_offload_moves_block_activations_at_link_bandwidth(small_gpt, a100) -> None:
    base, off = both(small_gpt, a100, offload=Offload(activations=True))
    a, bw = base.block.act_bytes, a100.host_link_bandwidth_bytes_per_s
    assert a > 0 and off.block.act_bytes == 0.0
    assert off.block.fwd_s == pytest.approx(base.block.fwd_s + a / bw)
    assert off.block.bwd_s == pytest.approx(base.block.bwd_s + a / bw)
    assert off.transient_bytes == pytest.approx(base.transient_bytes + a)  # one block back for its backward
    assert off.pre == base.pre and off.post == base.post  # embedding and head keep theirs
    assert off.state_split == base.state_split


def test_host_memory_is_summed_over_each_nodes_gpus(small_gpt, a100) -> None:
    # pp 4 x dp 2 x tp 2 = 16 GPUs on 8-GPU nodes: node 0 holds pipeline ranks 0 and 1 (4 GPUs each)
    c = cfg(dp=2, tp=2, pp=4, global_batch=16, offload=Offload(optimizer=True, activations=True))
    terms = build_terms(small_gpt, a100, c)
    est = evaluate_with_host(terms, [4, 4, 4, 4], 1.0, 1.0, a100)
    per_rank = [rk.params * terms.offload.host_state_bytes_per_param
                + inflight_microbatches("1f1b", 4, rk.rank, 8) * 4 * terms.offload.host_act_bytes_per_block
                for rk in est.ranks]
    assert est.host["host_memory_bytes_per_gpu"] == pytest.approx(max(per_rank))
    assert est.host["host_memory_bytes"] == pytest.approx(max(4 * per_rank[0] + 4 * per_rank[1],
                                                              4 * per_rank[2] + 4 * per_rank[3]))
    assert host_per_node(terms, [1.0, 2.0, 3.0, 4.0], 8) == 4 * 3 + 4 * 4


def test_host_memory_per_node_refuses_a_plan(small_gpt, a100) -> None:
    c = cfg(offload=Offload(optimizer=True))
    tight = dataclasses.replace(a100, host_memory_bytes_per_node=1e6)
    est = evaluate_with_host(build_terms(small_gpt, tight, c), [16], 1.0, 1.0, tight)
    assert est.peak_memory_bytes <= est.capacity_bytes and not est.fits
    assert evaluate_with_host(build_terms(small_gpt, a100, c), [16], 1.0, 1.0, a100).fits


def _space(**changes) -> SearchSpace:
    return SearchSpace(num_gpus=8, gpus_per_node=8, global_batch=16, seq_len=1024, micro_batches=(1,), **changes)


def test_offload_is_searched_only_where_it_is_needed(small_gpt, a100) -> None:
    # Plenty of GPU memory: every plan fits without offload, so none offloads.
    roomy = search(small_gpt, a100, _space(), top_k=3)
    assert roomy.top and not any(c.config.offload.any for c in roomy.top)
    # GPU memory below the smallest plan without offload: the search finds offload plans.
    plain = search(small_gpt, a100, _space(offload_modes=("none",)), top_k=1)
    small = plain.top[0].estimate.peak_memory_bytes
    # Find a capacity just under the smallest no-offload plan's peak (the min over the whole space)
    floor = search(small_gpt, dataclasses.replace(a100, memory_bytes=1.0), _space(offload_modes=("none",)))
    cap = floor.min_memory_bytes * 0.97
    tight = dataclasses.replace(a100, memory_bytes=cap)
    assert not search(small_gpt, tight, _space(offload_modes=("none",))).top
    found = search(small_gpt, tight, _space(), top_k=3)
    assert found.top and all(c.config.offload.any for c in found.top) and small > cap
    assert all(c.estimate.fits and c.estimate.host["host_memory_bytes"] <= a100.host_memory_bytes_per_node
               for c in found.top)
    # ... but not where the host cannot hold the states either
    no_host = search(small_gpt, dataclasses.replace(tight, host_memory_bytes_per_node=1e6), _space())
    assert not no_host.top and no_host.rejected.get("memory: host memory per node", 0) > 0


def test_a_profile_without_host_figures_offers_no_offload(small_gpt, a100) -> None:
    bare = dataclasses.replace(a100, host_memory_bytes_per_node=0.0, memory_bytes=1.0)
    result = search(small_gpt, bare, _space())
    assert not result.top and any("no host: section" in why for why in result.rejected)
    with pytest.raises(PlanError, match="no host: section"):
        build_terms(small_gpt, bare, cfg(offload=Offload(optimizer=True)))


def test_no_plan_fits_names_host_memory(a100, tmp_path) -> None:
    from autopar.search.driver import search_plans

    model = tmp_path / "gpt.py"
    model.write_text(
        "from autopar.models.gpt import GPT, GPTConfig, example_tokens, next_token_loss\n"
        "CONFIG = GPTConfig(num_layers=4, hidden_size=256, num_heads=4, seq_len=128, vocab_size=512)\n"
        "SEQ_LEN = CONFIG.seq_len\n"
        "def build_model():\n    return GPT(CONFIG)\n"
        "def example_inputs(micro_batch_size):\n    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)\n")
    tiny = dataclasses.replace(a100, memory_bytes=float(a100.framework_reserve_bytes) + 1e5)
    with pytest.raises(InfeasibleError) as err:
        search_plans(str(model), gpus=2, cluster=tiny, cluster_ref="a100-80g", micro_batches=(1,), use_cache=False)
    text = str(err.value)
    assert "GiB without offload; with offload " in text and "GiB of host memory per node (offload " in text


def test_no_plan_fits_says_how_much_host_memory_a_plan_that_fits_the_gpus_needs(small_gpt, a100) -> None:
    from autopar.search.offload_need import least_host_that_fits, needed_text

    floor = search(small_gpt, dataclasses.replace(a100, memory_bytes=1.0), _space(offload_modes=("none",)))
    # GPUs too small for any plan without offload, host memory too small for any with it
    tight = dataclasses.replace(a100, memory_bytes=floor.min_memory_bytes * 0.97, host_memory_bytes_per_node=1e3)
    result = search(small_gpt, tight, _space())
    assert not result.top
    host, cfg = least_host_that_fits(small_gpt, tight, _space())
    assert cfg is not None and cfg.offload.any and host > 1e3
    text = needed_text(small_gpt, tight, _space(), result)
    assert text.startswith(f"{floor.min_memory_bytes / 2**30:,.1f} GiB without offload; ")
    assert f"with offload it fits the GPUs but needs {host / 2**30:,.1f} GiB of host memory per node" in text
    assert f"offload {cfg.offload.label}, dp {cfg.dp} x tp {cfg.tp}" in text


def test_old_plans_round_trip_without_an_offload_key(make_plan) -> None:
    plan = make_plan(16, dp=8, zero=1)
    text = dump_plan(plan)
    assert "offload" not in text and parse_plan(text) == plan and parse_plan(text).parallel.offload == NO_OFFLOAD
    off = make_plan(16, dp=8, zero=1, offload={"optimizer": True, "activations": True})
    again = parse_plan(dump_plan(off))
    assert again == off and again.parallel.offload == Offload(optimizer=True, activations=True)
    assert "offload: {optimizer: true, params: false, grads: false, activations: true}" in dump_plan(off)


@pytest.mark.parametrize("parallel, message", [
    (dict(dp=8, zero=1, offload={"params": True, "grads": True, "optimizer": True}), "needs zero 3"),
    (dict(dp=8, zero=3, offload={"params": True, "optimizer": True}), "parameters and gradients together"),
    (dict(dp=8, zero=3, offload={"params": True, "grads": True}), "set optimizer: true"),
    (dict(dp=8, zero=1, recompute="full", offload={"activations": True}), "recompute none"),
    (dict(dp=8, offload={"optimiser": True}), "unknown key 'parallel.offload.optimiser'"),
    (dict(dp=8, offload={"optimizer": "yes"}), "must be true or false"),
])
def test_bad_offload_is_a_plan_error_naming_the_fix(make_plan, parallel, message) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(16, **parallel)


def test_offload_labels_round_trip() -> None:
    from autopar.plan import OFFLOAD_LABELS

    assert [Offload.from_label(x).label for x in OFFLOAD_LABELS] == list(OFFLOAD_LABELS)
    assert Offload.from_label("params") == Offload(optimizer=True, params=True, grads=True)


def test_profiles_gain_host_figures_and_old_ones_load() -> None:
    for name in ("a100-80g", "h100-80g", "h200-141g", "h100-80g-megatron"):
        assert load_cluster(name).has_host
    assert load_cluster("h100-80g").host_link_bandwidth_bytes_per_s > load_cluster("a100-80g").host_link_bandwidth_bytes_per_s
    assert not load_cluster("cpu-local-2").has_host  # no host: section -- still loads
    data = {"gpu": {"name": "x", "peak_flops": 1e12, "memory_bytes": 1e9, "memory_bandwidth_bytes_per_s": 1e11,
                    "framework_reserve_bytes": 0},
            "network": {"gpus_per_node": 1, "intra_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0},
                        "inter_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0}},
            "efficiency": {"gemm_max": 1, "gemm_half_dim": 1, "attention": 0.5, "memory": 1, "kernel_overhead_s": 0}}
    assert not cluster_from_dict(data, "x").has_host
    assert cluster_from_dict({**data, "host": {"memory_bytes_per_node": 1e12}}, "x").host_memory_bytes_per_node == 1e12
    with pytest.raises(ClusterError, match="unknown key 'memory'"):
        cluster_from_dict({**data, "host": {"memory": 1}}, "x")


def test_explain_and_estimate_json_show_host_memory_and_offload_traffic(small_gpt, a100, make_plan) -> None:
    from autopar.cost.estimate import estimate_json, estimate_plan
    from autopar.explain.explanation import explain_plan, format_explanation

    plan = make_plan(16, dp=8, zero=1, offload={"optimizer": True, "activations": True})
    est = estimate_plan(plan, small_gpt, a100)
    out = estimate_json(est)
    contract = {"step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "memory_bytes"}
    assert contract <= set(out) and out["memory_bytes"]["optimizer"] == 0.0
    assert out["offload"] == "optimizer+activations" and out["host_memory_bytes"] == est.host["host_memory_bytes"]
    # 8 GPUs of one node, each holding K / 8 = 1.5 bytes per parameter and its in-flight activations
    terms = build_terms(small_gpt, a100, dataclasses.replace(cfg(dp=8, tp=1, global_batch=64), offload=plan.parallel.offload))
    per_gpu = est.ranks[0].params * 12 / 8 + est.ranks[0].num_blocks * terms.offload.host_act_bytes_per_block
    assert out["host_memory_bytes"] == pytest.approx(8 * per_gpu)
    m = plan.num_microbatches
    assert out["offload_traffic_bytes_per_gpu"] == pytest.approx(
        est.ranks[0].params * 2 * 2 / 8 + 2 * m * 16 * terms.offload.host_act_bytes_per_block)
    text = format_explanation(explain_plan(plan, small_gpt, a100))
    assert "== offload: optimizer+activations ==" in text and "offload optimizer+activations" in text
    assert f"host memory {out['host_memory_bytes'] / 2**30:,.1f} GiB per node of 1,862.6 GiB" in text
    assert "offload traffic" in text and "CPU optimizer step" in text
    plain = estimate_json(estimate_plan(make_plan(16, dp=8, zero=1), small_gpt, a100))
    assert "host_memory_bytes" not in plain and "offload" not in plain  # old outputs unchanged


@pytest.mark.parametrize("dp,tp,pp", [(4, 2, 4), (1, 8, 4), (2, 2, 8), (16, 8, 2), (1, 2, 16), (3, 2, 4), (1, 1, 6)])
def test_host_per_node_closed_forms_equal_the_node_walk(small_gpt, a100, dp, tp, pp) -> None:
    """A pipeline rank spanning whole nodes, or a node holding whole pipeline ranks, is summed in
    closed form; both equal visiting every node."""
    terms = build_terms(small_gpt, a100, cfg(dp=dp, tp=tp, pp=pp, zero=0, offload=Offload(optimizer=True)))
    per_rank = [float((r * 7) % 5 + r) for r in range(pp)]
    inner, g = dp * tp, 8
    walk = max(sum(per_rank[r // inner] for r in range(first, min(first + g, dp * tp * pp)))
               for first in range(0, dp * tp * pp, g))
    assert host_per_node(terms, per_rank, g) == pytest.approx(walk)


def test_no_plan_fits_with_ep_says_so_without_offload_figures(a100) -> None:
    """Expert parallelism takes no offload (plan.offload_reason): a search constrained to ep 2 that
    fits nothing has no offload configuration to describe, and says what the GPUs lack -- it read
    the host figures of its smallest configuration, which held no offload (AttributeError)."""
    from pathlib import Path

    from autopar.search.driver import search_plans

    model = Path(__file__).resolve().parents[2] / "examples" / "zoo" / "torch_moe.py"
    tiny = dataclasses.replace(a100, memory_bytes=float(a100.framework_reserve_bytes) + 1e5)
    with pytest.raises(InfeasibleError) as err:
        search_plans(str(model), gpus=2, cluster=tiny, cluster_ref="a100-80g", micro_batches=(1,), use_cache=False,
                     constraints={"ep": (2,)})
    assert "GiB without offload" in str(err.value) and "host memory" not in str(err.value)
