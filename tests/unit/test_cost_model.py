"""Cost-model units (docs/design.md §5): collectives on the right link, in-flight micro-batches per schedule, the step
model (bubble, interleaving, tails), ZeRO, SP, recompute, CP and MFU."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autopar.cluster import load_cluster
from autopar.cost.comm import axis_link, collective_time_s, group_link
from autopar.cost.estimate import estimate_json, estimate_plan
from autopar.cost.memory import inflight_microbatches
from autopar.cost.stage import Part, StageTerms, build_terms
from autopar.cost.step import evaluate
from autopar.errors import PlanError
from autopar.layout import Layout

# ---------------------------------------------------------------- communication


def test_group_inside_a_node_uses_nvlink(a100) -> None:
    for size in (2, 4, 8):
        g = group_link(a100, size, 1)
        assert g.intra_node and g.link_name == "nvlink" and g.members_per_node == size
        assert g.bandwidth_bytes_per_s == a100.intra_node.bandwidth_bytes_per_s
    g = axis_link(a100, Layout(pp=1, dp=4, cp=1, tp=2), "dp")  # 4 ranks at stride 2: still one node
    assert g.intra_node


def test_dp_group_with_tp8_spans_nodes_with_one_member_per_node(a100) -> None:
    mesh = Layout(pp=1, dp=8, cp=1, tp=8)
    g = axis_link(a100, mesh, "dp")
    assert not g.intra_node and g.link_name == "network"
    assert g.members_per_node == 1 and g.size == 8
    assert g.bandwidth_bytes_per_s == a100.inter_node.bandwidth_bytes_per_s
    assert axis_link(a100, mesh, "tp").intra_node


def test_cross_node_group_shares_the_node_nics(a100) -> None:
    """k members per node ride k NIC rails (capped by NVLink)."""
    g = axis_link(a100, Layout(pp=1, dp=16, cp=1, tp=2), "dp")  # stride 2: 4 members per node
    assert not g.intra_node and g.members_per_node == 4
    assert g.bandwidth_bytes_per_s == pytest.approx(4 * a100.inter_node.bandwidth_bytes_per_s)
    g = group_link(a100, 64, 1)  # 8 members per node
    assert g.bandwidth_bytes_per_s == min(a100.intra_node.bandwidth_bytes_per_s, 8 * a100.inter_node.bandwidth_bytes_per_s)


def test_mesh_layout_pp_dp_cp_tp(a100) -> None:
    mesh = Layout(pp=4, dp=2, cp=2, tp=2)
    assert [mesh.stride(a) for a in ("tp", "cp", "dp", "pp")] == [1, 2, 4, 8]
    assert mesh.size("dp_cp") == 4 and mesh.stride("dp_cp") == 2
    pp = axis_link(a100, mesh, "pp")
    assert pp.size == 2 and not pp.intra_node  # neighbouring stages are 8 ranks apart: the next node
    assert axis_link(a100, Layout(pp=2, dp=1, cp=1, tp=4), "pp").intra_node  # 4 apart: same node
    pp8 = axis_link(a100, Layout(pp=4, dp=1, cp=1, tp=8), "pp")
    assert not pp8.intra_node and pp8.members_per_node == 1


@pytest.mark.parametrize("size,stride", [(8, 1), (8, 8), (64, 1), (4, 2)])
@pytest.mark.parametrize("nbytes", [1e4, 1e6, 1e9])
def test_all_reduce_is_twice_reduce_scatter(a100, size: int, stride: int, nbytes: float) -> None:
    g = group_link(a100, size, stride)
    ar = collective_time_s("all_reduce", nbytes, g)
    rs = collective_time_s("reduce_scatter", nbytes, g)
    ag = collective_time_s("all_gather", nbytes, g)
    assert ag == pytest.approx(rs)
    n = size
    bw = g.bandwidth_bytes_per_s * g.link.efficiency(nbytes / n)
    ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * g.link.latency_s
    assert ring == pytest.approx(2 * rs)
    if g.intra_node:
        assert ar == pytest.approx(ring)
    else:  # across nodes NCCL's tree where it is cheaper: 2 M at the rail, 2 log2(nodes) + 2 (k - 1) hops
        k, nodes = g.members_per_node, size // g.members_per_node
        tree = 2 * nbytes / (g.bandwidth_bytes_per_s * g.link.efficiency(nbytes / k)) + (
            2 * math.ceil(math.log2(nodes)) + 2 * (k - 1)) * g.link.latency_s
        assert ar == pytest.approx(min(ring, tree)) and ar <= ring * (1 + 1e-12)


def test_collective_edge_cases(a100) -> None:
    g = group_link(a100, 8, 1)
    assert collective_time_s("all_reduce", 1e6, group_link(a100, 1, 1)) == 0.0
    assert collective_time_s("all_reduce", 0.0, g) == 0.0
    p2p = group_link(a100, 2, 8)
    assert collective_time_s("p2p", 1e8, p2p) == pytest.approx(
        1e8 / (p2p.bandwidth_bytes_per_s * p2p.link.efficiency(1e8)) + p2p.link.latency_s)
    # Bigger messages reach a higher fraction of the link.
    assert 1e9 / collective_time_s("all_reduce", 1e9, g) > 1e5 / collective_time_s("all_reduce", 1e5, g)
    with pytest.raises(ValueError):
        collective_time_s("broadcast", 1e6, g)


def test_network_collective_is_slower_than_nvlink(a100) -> None:
    inside = collective_time_s("all_reduce", 1e9, group_link(a100, 8, 1))
    across = collective_time_s("all_reduce", 1e9, group_link(a100, 8, 8))
    assert across > 5 * inside


# ---------------------------------------------------------------- in-flight micro-batches


@pytest.mark.parametrize("p", [2, 4, 8])
def test_1f1b_stage_r_holds_p_minus_r(p: int) -> None:
    assert [inflight_microbatches("1f1b", p, r, 64) for r in range(p)] == [p - r for r in range(p)]
    # Fewer micro-batches than stages: nobody holds more than M.
    assert [inflight_microbatches("1f1b", p, r, 1) for r in range(p)] == [1] * p


def test_gpipe_holds_every_microbatch() -> None:
    assert [inflight_microbatches("gpipe", 4, r, 32) for r in range(4)] == [32] * 4
    assert inflight_microbatches("gpipe", 1, 0, 32) == 1  # no pipeline: micro-batches run one after another


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (8, 3), (16, 4), (64, 2)])
def test_interleaved_first_rank_matches_korthikanti(p: int, v: int) -> None:
    """Korthikanti §4.2.3: the first stage of an interleaved schedule holds p·v·(1 + (p−1)/(p·v)) chunks
    (of L/(p·v) layers), i.e. L layers' worth times (1 + (p−1)/(p·v))."""
    chunks = inflight_microbatches("interleaved-1f1b", p, 0, 1000, v) * v
    assert chunks == pytest.approx(p * v * (1 + (p - 1) / (p * v)))
    held = [inflight_microbatches("interleaved-1f1b", p, r, 1000, v) for r in range(p)]
    assert held == sorted(held, reverse=True) and held[0] > inflight_microbatches("1f1b", p, 0, 1000)
    assert inflight_microbatches("interleaved-1f1b", p, 0, 1, v) <= 1  # capped by M·v chunks


def test_unknown_schedule() -> None:
    with pytest.raises(PlanError):
        inflight_microbatches("zero-bubble", 4, 0, 8)


# ---------------------------------------------------------------- the step model on synthetic stages


def _part(time_s: float = 0.0, act: float = 0.0, params: float = 0.0) -> Part:
    return Part(fwd_s=time_s / 3, bwd_s=2 * time_s / 3, recompute_s=0.0, tp_comm_s=0.0, cp_comm_s=0.0,
                zero_comm_s=0.0, act_bytes=act, params=params, fwd_flops=0.0, bwd_flops=0.0)


def _terms(make_config, *, pp: int, m: int, schedule: str = "1f1b", v: int = 1, block_s: float = 0.01) -> StageTerms:
    cfg = make_config(pp=pp, schedule=schedule, virtual_stages=v, micro_batch=1, global_batch=m)
    return StageTerms(config=cfg, block=_part(block_s, act=1.0, params=1.0), pre=_part(), post=_part(), p2p_s=0.0,
                      state_bytes_per_param=16.0, state_split={"params": 2.0, "grads": 2.0, "optimizer": 12.0},
                      grad_sync_s_per_param=0.0, grad_sync_floor_s=0.0, grad_sync_overlaps=True,
                      param_gather_s_per_param=0.0, optimizer_s_per_param=0.0, transient_bytes=0.0, tied_params=0.0,
                      reserve_bytes=0.0, capacity_bytes=1e12)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 4), (4, 32), (8, 64)])
def test_1f1b_bubble_uniform_stages(make_config, p: int, m: int) -> None:
    blocks_per_stage, t = 3, 0.01
    est = evaluate(_terms(make_config, pp=p, m=m, block_s=t), [blocks_per_stage] * p, 1.0, 1.0, 1.0)
    assert est.step_time_s == pytest.approx((m + p - 1) * blocks_per_stage * t)
    assert est.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 4), (8, 64, 3)])
def test_interleaving_shrinks_the_bubble_by_v(make_config, p: int, m: int, v: int) -> None:
    plain = evaluate(_terms(make_config, pp=p, m=m), [2 * v] * p, 1.0, 1.0, 1.0)
    inter = evaluate(_terms(make_config, pp=p, m=m, schedule="interleaved-1f1b", v=v), [2] * (p * v), 1.0, 1.0, 1.0)
    assert inter.bubble_fraction < plain.bubble_fraction
    assert inter.bubble_fraction == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))
    assert inter.ranks[0].num_blocks == plain.ranks[0].num_blocks == 2 * v


def test_slowest_stage_sets_the_steady_state(make_config) -> None:
    p, m, t = 4, 16, 0.01
    est = evaluate(_terms(make_config, pp=p, m=m, block_s=t), [2, 2, 5, 2], 1.0, 1.0, 1.0)
    assert est.step_time_s == pytest.approx((m - 1) * 5 * t + 11 * t)
    assert [r.num_blocks for r in est.ranks] == [2, 2, 5, 2]


def _simulate_1f1b(fwd: list[float], bwd: list[float], p2p_s: float, m: int) -> float:
    """Megatron's 1F1B by its definition, event by event: stage r runs min(m, p - r - 1) warm-up
    forwards, then one forward and one backward in turn, then the cool-down backwards; a forward
    needs the previous stage's forward of that micro-batch plus one P2P, a backward the next
    stage's backward plus one P2P (the last stage: its own forward). Blocking P2P: the sender is
    busy while it sends (torch.distributed.pipelining / Megatron wait for each transfer)."""
    p = len(fwd)
    order = []
    for r in range(p):
        warm = min(m, p - r - 1)
        ops, nf = [("F", i) for i in range(warm)], warm
        for nb in range(m):
            if nf < m:
                ops.append(("F", nf))
                nf += 1
            ops.append(("B", nb))
        order.append(ops)
    done: dict = {}
    free, pos = [0.0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(order[r]):
                kind, i = order[r][pos[r]]
                if kind == "F":
                    dep = 0.0 if r == 0 else done.get(("F", r - 1, i))
                    send = p2p_s if r < p - 1 else 0.0
                    work = fwd[r]
                else:
                    dep = done.get(("F", r, i)) if r == p - 1 else done.get(("B", r + 1, i))
                    send = p2p_s if r > 0 else 0.0
                    work = bwd[r]
                if dep is None:
                    break
                start = max(free[r], dep)
                done[(kind, r, i)] = start + work + send  # the next stage may start once the send is done
                free[r] = start + work + send
                pos[r] += 1
                progress = True
    return max(free)


@pytest.mark.parametrize("p,m", [(32, 128), (64, 512)])
def test_deep_1f1b_step_matches_the_schedule_by_definition(make_config, p: int, m: int) -> None:
    """At pp >= 32 the step formula ((M - 1) max_r t_r + sum_r t_r, t_r with its P2P sends) is the
    schedule's own makespan: P2P on the critical path once per boundary and direction, the first
    stage's embedding and the last stage's head and loss making them the slow ones."""
    block_s, p2p_s = 0.01, 0.0005
    terms = dataclasses.replace(_terms(make_config, pp=p, m=m, block_s=block_s), p2p_s=p2p_s,
                                pre=_part(0.004), post=_part(0.012))
    est = evaluate(terms, [2] * p, 1.0, 1.0, 1.0)
    fwd = [2 * block_s / 3] * p
    bwd = [2 * 2 * block_s / 3] * p
    fwd[0] += 0.004 / 3
    bwd[0] += 2 * 0.004 / 3
    fwd[-1] += 0.012 / 3
    bwd[-1] += 2 * 0.012 / 3
    simulated = _simulate_1f1b(fwd, bwd, p2p_s, m)
    assert est.step_time_s == pytest.approx(simulated, rel=0.005)
    assert est.step_time_s >= simulated * (1 - 1e-9)  # never optimistic


# ---------------------------------------------------------------- the full estimate on a real model


def _est(graph, cluster, make_plan, **kw):
    return estimate_plan(make_plan(graph.num_blocks, **kw), graph, cluster)


def test_no_pipeline_step_is_microbatches_times_microbatch_time_plus_tail(small_gpt, a100, make_plan) -> None:
    for dp, gbs in ((1, 8), (8, 64)):
        est = _est(small_gpt, a100, make_plan, dp=dp, global_batch_size=gbs)
        m = gbs // dp
        rank = est.ranks[0]
        assert est.step_time_s == pytest.approx(m * rank.time_s + rank.tail_s)
        assert est.bubble_fraction == pytest.approx(0.0, abs=1e-12)
        assert (rank.tail_s > est.time_breakdown_s["optimizer"]) == (dp > 1)  # DP gradient all-reduce tail


def test_time_breakdown_sums_to_the_step(small_gpt, a100, make_plan) -> None:
    for kw in (dict(pp=4, tp=2, dp=2, sequence_parallel=True), dict(dp=8, tp=8, zero=3, recompute="full"),
               dict(pp=2, cp=2, recompute="selective", pp_schedule="interleaved-1f1b", pp_virtual_stages=2)):
        est = _est(small_gpt, a100, make_plan, **kw)
        assert sum(est.time_breakdown_s.values()) == pytest.approx(est.step_time_s, rel=1e-9), kw


def test_1f1b_bubble_on_a_real_model(small_gpt, a100, make_plan) -> None:
    p, gbs = 4, 16
    est = _est(small_gpt, a100, make_plan, pp=p, global_batch_size=gbs)
    m = gbs
    assert est.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=0.25)
    inter = _est(small_gpt, a100, make_plan, pp=p, global_batch_size=gbs, pp_schedule="interleaved-1f1b",
                 pp_virtual_stages=2)
    assert inter.bubble_fraction < 0.75 * est.bubble_fraction
    assert inter.step_time_s < est.step_time_s


def test_pipeline_activation_memory_per_schedule(small_gpt, a100, make_plan) -> None:
    """1F1B's first stage holds p micro-batches (L layers' worth), GPipe all M."""
    p, m = 4, 32
    one = _est(small_gpt, a100, make_plan, pp=p, global_batch_size=m)
    gpipe = _est(small_gpt, a100, make_plan, pp=p, global_batch_size=m, pp_schedule="gpipe")
    inter = _est(small_gpt, a100, make_plan, pp=p, global_batch_size=m, pp_schedule="interleaved-1f1b",
                 pp_virtual_stages=2)
    blocks = [r.memory_bytes["activations"] for r in one.ranks]
    assert blocks == sorted(blocks, reverse=True)
    mid = [one.ranks[r].memory_bytes["activations"] / (p - r) for r in (1, 2)]
    assert mid[0] == pytest.approx(mid[1])  # same blocks per stage: activations ∝ in-flight micro-batches
    assert gpipe.ranks[1].memory_bytes["activations"] == pytest.approx(m / (p - 1) * one.ranks[1].memory_bytes["activations"])
    assert inter.ranks[1].memory_bytes["activations"] / one.ranks[1].memory_bytes["activations"] == pytest.approx(
        (2 * (p - 2) + p + 1) / 2 / (p - 1))


def test_zero3_cuts_state_memory_and_adds_zero_comm(small_gpt, a100, make_plan) -> None:
    base = _est(small_gpt, a100, make_plan, dp=8, tp=8, zero=0)
    z3 = _est(small_gpt, a100, make_plan, dp=8, tp=8, zero=3)
    states = lambda e: e.memory_bytes["params"] + e.memory_bytes["grads"] + e.memory_bytes["optimizer"]  # noqa: E731
    # ZeRO-0 at tp > 1 is FSDP2's replicate, whose gradients are fp32 (2 bytes more per parameter)
    assert states(z3) == pytest.approx((states(base) - 2 * base.ranks[0].params) / 8)
    assert base.time_breakdown_s["zero_comm"] == 0.0 and z3.time_breakdown_s["zero_comm"] > 0.0
    assert z3.memory_bytes["other"] > base.memory_bytes["other"]  # the gathered layer is a transient buffer
    # each ZeRO stage holds less than the one before (at tp 1, DDP's bucket copy in ZeRO-0)
    base, z1, z2, z3 = (_est(small_gpt, a100, make_plan, dp=8, zero=z) for z in (0, 1, 2, 3))
    assert states(base) > states(z1) > states(z2) > states(z3)
    # FSDP2's fp32 shards (cost.zero.fp32_shards): ZeRO-2's master shard counts with its parameters
    params = z2.ranks[0].params
    assert z2.memory_bytes["optimizer"] + 4 / 8 * params == pytest.approx(z1.memory_bytes["optimizer"])
    assert z2.memory_bytes["grads"] < z1.memory_bytes["grads"]


def test_sequence_parallel_cuts_activation_memory(a100_megatron, make_config) -> None:
    from autopar.reference import KORTHIKANTI_22B, gpt_graph

    a100 = a100_megatron
    g = gpt_graph(KORTHIKANTI_22B, "fp16")
    off = build_terms(g, a100, make_config(tp=8, micro_batch=4)).block
    on = build_terms(g, a100, make_config(tp=8, micro_batch=4, sequence_parallel=True)).block
    assert on.act_bytes < off.act_bytes
    s, h, a, t = 2048, 6144, 64, 8  # b = 4 cancels in the ratio
    # a100-80g-megatron prices Megatron-LM, which saves the sequence shard: Korthikanti et al.'s 34/t per s*b*h
    assert on.act_bytes / off.act_bytes == pytest.approx((34 / t + 5 * a * s / (h * t)) / (10 + 24 / t + 5 * a * s / (h * t)),
                                                         rel=0.02)
    # under DTensor SP (autopar run) the two column-parallel Linears' gathered inputs stay whole
    executor = dataclasses.replace(a100, sp_saves_gathered_input=True)
    dt_on = build_terms(g, executor, make_config(tp=8, micro_batch=4, sequence_parallel=True)).block
    assert dt_on.act_bytes / off.act_bytes == pytest.approx(
        (30 / t + 4 + 5 * a * s / (h * t)) / (10 + 24 / t + 5 * a * s / (h * t)), rel=0.02)
    assert on.tp_comm_s > 0 and off.tp_comm_s > 0


def test_recompute_modes_trade_memory_for_time(a100, make_config) -> None:
    from autopar.reference import KORTHIKANTI_22B, gpt_graph

    g = gpt_graph(KORTHIKANTI_22B, "fp16")
    parts = {rc: build_terms(g, a100, make_config(tp=8, micro_batch=4, recompute=rc)).block
             for rc in ("none", "selective", "full")}
    none, sel, full = parts["none"], parts["selective"], parts["full"]
    assert full.act_bytes < sel.act_bytes < none.act_bytes
    assert none.recompute_s == 0.0 < sel.recompute_s < full.recompute_s
    # Full recompute re-runs the layer's forward in backward.
    assert full.recompute_s == pytest.approx(full.fwd_s)
    assert full.bwd_s - none.bwd_s == pytest.approx(none.fwd_s, rel=1e-9)
    # Selective re-runs only the attention core.
    assert sel.bwd_s - none.bwd_s == pytest.approx(sel.recompute_s)
    assert sel.recompute_s < 0.3 * none.fwd_s
    assert none.fwd_s == sel.fwd_s == full.fwd_s


def test_recompute_on_whole_plans(small_gpt, a100, make_plan) -> None:
    ests = {rc: _est(small_gpt, a100, make_plan, pp=2, tp=2, recompute=rc) for rc in ("none", "selective", "full")}
    act = {rc: e.memory_bytes["activations"] for rc, e in ests.items()}
    assert act["full"] < act["selective"] < act["none"]
    assert ests["none"].step_time_s < ests["selective"].step_time_s < ests["full"].step_time_s
    assert ests["none"].time_breakdown_s["recompute"] == 0.0 < ests["full"].time_breakdown_s["recompute"]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_ring_divides_activation_memory(a100_megatron, make_config, recompute: str, cp: int) -> None:
    """Under Megatron's bf16 parameters every saved activation is per token (autopar run's autocast
    keeps a weight copy per micro-batch besides, which cp does not divide) -- except the explicit
    attention core's s^2 tensors, which no cp kind keeps: its flash kernels keep their output and
    log-sum-exp instead (stage._cp_flash_core), so without recompute a cp rank holds 1/cp of the
    block's other saved bytes plus those."""
    from autopar.models.gpt import GPTConfig
    from autopar.reference import gpt_graph

    a100 = a100_megatron
    g = gpt_graph(GPTConfig(num_layers=2, hidden_size=2048, num_heads=16, seq_len=4096, vocab_size=51200), "bf16")
    one = build_terms(g, a100, make_config(tp=2, recompute=recompute, seq_len=4096)).block
    ring = build_terms(g, a100, make_config(tp=2, cp=cp, recompute=recompute, seq_len=4096)).block
    if recompute == "none":
        mb, tokens = 1, 4096 // cp  # make_config's micro-batch of 1
        without_core = build_terms(g, a100, make_config(tp=2, recompute="selective", seq_len=4096)).block
        flash = mb * tokens * 2048 / 2 * 2 + mb * tokens * 16 / 2 * 4  # output (bf16) and log-sum-exp (fp32)
        assert ring.act_bytes == pytest.approx(without_core.act_bytes / cp + flash, rel=1e-9)
        assert ring.act_bytes < one.act_bytes / cp
    else:
        assert ring.act_bytes == pytest.approx(one.act_bytes / cp, rel=1e-9)
    assert ring.fwd_s < one.fwd_s


def test_cp_kinds_communicate(a100, make_config) -> None:
    from autopar.models.gpt import GPTConfig
    from autopar.reference import gpt_graph

    g = gpt_graph(GPTConfig(num_layers=2, hidden_size=2048, num_heads=16, seq_len=4096, vocab_size=51200), "bf16")
    for kind in ("ring", "allgather", "ulysses"):
        none = build_terms(g, a100, make_config(tp=2, seq_len=4096)).block
        part = build_terms(g, a100, make_config(tp=2, cp=4, cp_kind=kind, seq_len=4096)).block
        assert none.cp_comm_s == 0.0 and part.cp_comm_s >= 0.0
        if kind != "ring":  # all-gather and all-to-all are not overlapped with attention
            assert part.cp_comm_s > 0.0


def test_plan_checks_against_the_model(small_gpt, a100, make_plan) -> None:
    with pytest.raises(PlanError, match="blocks"):
        estimate_plan(make_plan(small_gpt.num_blocks + 1), small_gpt, a100)
    with pytest.raises(PlanError, match="ulysses"):  # 16 heads over tp x cp = 32
        _est(small_gpt, a100, make_plan, tp=8, cp=4, cp_kind="ulysses")
    with pytest.raises(PlanError, match="seq_len"):  # ring needs 2 x cp chunks
        _est(small_gpt, a100, make_plan, cp=4, seq_len=1020)


def test_mfu_counts_model_flops_without_recompute(small_gpt, a100, make_plan) -> None:
    none = _est(small_gpt, a100, make_plan, tp=2, recompute="none")
    full = _est(small_gpt, a100, make_plan, tp=2, recompute="full")
    assert none.mfu * none.step_time_s == pytest.approx(full.mfu * full.step_time_s, rel=1e-12)
    assert full.mfu < none.mfu
    gpus, gbs = 2, 64
    flops = small_gpt.model_flops_per_sample() * gbs
    assert none.mfu == pytest.approx(flops / (none.step_time_s * gpus * a100.peak_flops))
    assert none.tokens_per_s == pytest.approx(gbs * 1024 / none.step_time_s)
    assert 0.1 < none.mfu < 0.8


def test_faster_hardware_is_faster(a100, make_plan) -> None:
    """On compute-bound work (GEMMs of width 4096, fused attention, no TP collectives) an H100 is
    more than twice an A100 (989 vs 312 TFLOP/s dense bf16). The 16-layer small GPT is not such
    work: at width 1024 with its s^2 softmax unfused it is element-wise bound, where each GPU's
    fitted element-wise share decides (docs/cost-model.md)."""
    from autopar.models.gpt import GPTConfig
    from autopar.reference import gpt_graph

    graph = gpt_graph(GPTConfig(num_layers=16, hidden_size=4096, num_heads=32, seq_len=2048, vocab_size=512,
                                fused_attention=True), "bf16")
    h100 = load_cluster("h100-80g")
    plan = make_plan(graph.num_blocks, pp=2, micro_batch_size=4, seq_len=2048)
    assert estimate_plan(plan, graph, h100).step_time_s < 0.5 * estimate_plan(plan, graph, a100).step_time_s
    g = load_cluster("h200-141g")
    assert estimate_plan(plan, graph, g).step_time_s <= estimate_plan(plan, graph, h100).step_time_s
    assert estimate_plan(plan, graph, g).capacity_bytes > estimate_plan(plan, graph, h100).capacity_bytes


def test_memory_breakdown_and_json_contract(small_gpt, a100, make_plan) -> None:
    est = _est(small_gpt, a100, make_plan, pp=4, dp=2, tp=2, zero=1, recompute="selective")
    for rank in est.ranks:
        assert set(rank.memory_bytes) == {"params", "grads", "optimizer", "activations", "other"}
        assert rank.memory_bytes["other"] >= a100.framework_reserve_bytes
        assert rank.peak_bytes == pytest.approx(sum(rank.memory_bytes.values()))
    assert est.peak_memory_bytes == max(r.peak_bytes for r in est.ranks)
    assert est.capacity_bytes == a100.usable_memory_bytes < a100.memory_bytes and est.fits  # the profile's margin left free
    data = estimate_json(est)
    for key in ("step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes"):
        assert isinstance(data[key], float) and data[key] > 0
    assert set(data["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "other"}
    assert sum(data["memory_bytes"].values()) == pytest.approx(data["peak_memory_bytes"])


def test_estimate_is_deterministic_and_frozen(small_gpt, a100, make_plan) -> None:
    plan = make_plan(small_gpt.num_blocks, tp=4, pp=2)
    a, b = estimate_plan(plan, small_gpt, a100), estimate_plan(plan, small_gpt, a100)
    assert a.step_time_s == b.step_time_s and a.memory_bytes == b.memory_bytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.step_time_s = 0.0  # type: ignore[misc]


# ---------------------------------------------------------------- cluster profiles


def test_shipped_profiles_load_with_their_datasheet_figures() -> None:
    from autopar.cluster import list_profiles

    assert {"a100-80g", "h100-80g", "h200-141g"} <= set(list_profiles())
    a100, h100, h200 = (load_cluster(n) for n in ("a100-80g", "h100-80g", "h200-141g"))
    assert a100.peak_flops == 312e12 and a100.gpus_per_node == 8 and a100.memory_bytes == 81_050 * 2**20  # what torch reports, not 80 GiB
    assert a100.inter_node.bandwidth_bytes_per_s == 25e9  # one 200 Gb/s HDR rail per GPU
    assert h100.peak_flops > 3 * a100.peak_flops and h200.memory_bytes > h100.memory_bytes
    for c in (a100, h100, h200):
        assert c.intra_node.bandwidth_bytes_per_s > c.inter_node.bandwidth_bytes_per_s
        assert 0 < c.gemm_flops_per_s(8192, 8192, 8192) <= c.peak_flops
        # small GEMMs cannot fill the GPU (a100: its efficiency curve; h100/h200: the measured table)
        assert c.gemm_flops_per_s(128, 128, 128) < c.gemm_flops_per_s(8192, 8192, 8192)


def test_cluster_profile_errors_name_the_field(tmp_path) -> None:  # noqa: ANN001
    import yaml

    from autopar.errors import ClusterError

    with pytest.raises(ClusterError, match="a100-80g"):
        load_cluster("tpu-v5")  # the message lists the known profiles
    data = yaml.safe_load(open(load_cluster("a100-80g").source))
    del data["gpu"]["peak_flops"]
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ClusterError, match="peak_flops") as info:
        load_cluster(str(path))
    assert "broken.yaml" in str(info.value) and "\n" not in str(info.value)
    data = yaml.safe_load(open(load_cluster("a100-80g").source))
    data["software"]["overlap_grad_reduce"] = "sometimes"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ClusterError, match="overlap_grad_reduce"):
        load_cluster(str(path))


def _dp_traffic(graph, cluster, make_plan, **kw) -> tuple[float, int]:
    """(bytes a rank sends over the dp x cp group per step, calls per step) from explain's volume."""
    from autopar.explain.volume import communication_volume

    vol = communication_volume(make_plan(graph.num_blocks, **kw), graph, cluster)[0]
    items = [i for i in vol.items if i.axis == "dp_cp"]
    return sum(i.sent_bytes_per_step for i in items), sum(i.calls_per_step for i in items)


@pytest.mark.parametrize("tp", [1, 2])
def test_zero1_traffic_per_step_is_independent_of_micro_batches_zero2_grows(small_gpt, a100, make_plan, tp) -> None:
    traffic = {(z, m): _dp_traffic(small_gpt, a100, make_plan, dp=4, tp=tp, zero=z, global_batch_size=4 * m,
                                   micro_batch_size=1) for z in (1, 2) for m in (2, 8)}
    assert traffic[(1, 2)] == traffic[(1, 8)]  # one reduce-scatter + one all-gather per step
    assert traffic[(2, 8)][0] == pytest.approx(4 * traffic[(2, 2)][0])  # both, in every micro-batch
    assert traffic[(2, 2)][0] == pytest.approx(2 * traffic[(1, 2)][0])
    # The estimate prices the same: ZeRO-2's per-micro-batch collectives cost more at M = 8.
    z1, z2 = (_est(small_gpt, a100, make_plan, dp=4, tp=tp, zero=z, global_batch_size=32, micro_batch_size=1)
              for z in (1, 2))
    assert z1.time_breakdown_s["zero_comm"] == 0 < z2.time_breakdown_s["zero_comm"]
    assert z1.step_time_s < z2.step_time_s
    # ... and ZeRO-2 holds 1/dp of the gradients (FSDP2's fp32 shard) where ZeRO-1 holds a whole fp32
    # accumulator; its fp32 master shard counts with the parameters (cost.zero.fp32_shards)
    params = z1.ranks[0].params
    assert z1.memory_bytes["grads"] == pytest.approx(4 * params)
    assert z2.memory_bytes["grads"] == pytest.approx(4 * params / 4)
    assert z1.memory_bytes["optimizer"] == pytest.approx(z2.memory_bytes["optimizer"] + 4 * params / 4)


def test_zero2_with_pipeline_is_priced_as_the_zero1_it_runs_as(small_gpt, a100, make_plan) -> None:
    z1, z2 = (_est(small_gpt, a100, make_plan, dp=2, pp=2, zero=z, global_batch_size=16, micro_batch_size=1)
              for z in (1, 2))
    assert z1.step_time_s == z2.step_time_s and z1.peak_memory_bytes == z2.peak_memory_bytes
