"""Expert parallelism on a layer chain (a dense first unit, then units holding the experts:
DeepSeek's structure): the cost model prices the all-to-alls, the sharded experts and their
states on the units that hold them and leaves the dense unit as it was; estimate reports the
experts of the chain; the search offers ep. Checked on a plain-torch chain (tests/dist/models/
chain_moe_list.py: one dense layer, three with an nn.ModuleList of 4 experts, top-2)."""

from __future__ import annotations

import copy
import functools
from collections import Counter
from pathlib import Path

import pytest

from autopar.cluster import load_cluster
from autopar.cost.chain import build_chain_terms, evaluate_chain
from autopar.cost.estimate import config_from_plan, estimate_json, estimate_plan
from autopar.graph.measure import build_graph
from autopar.plan import plan_from_dict

CHAIN_MOE = Path(__file__).resolve().parents[1] / "dist" / "models" / "chain_moe_list.py"
BASE = {
    "version": 1,
    "model": {"file": str(CHAIN_MOE), "num_blocks": 4},
    "cluster": {"profile": "a100-80g", "num_gpus": 8, "gpus_per_node": 8},
    "training": {"global_batch_size": 32, "micro_batch_size": 2, "seq_len": 16, "dtype": "bf16", "optimizer": "adam"},
    "parallel": {"dp": 8, "tp": 1, "pp": 1},
}


def _plan(**parallel):
    data = copy.deepcopy(BASE)
    data["parallel"].update(parallel)
    return plan_from_dict(data)


@functools.lru_cache(maxsize=None)
def _graph():
    return build_graph(str(CHAIN_MOE))


def _terms(**parallel):
    return build_chain_terms(_graph(), load_cluster("a100-80g"), config_from_plan(_plan(**parallel)))


def test_the_graph_marks_the_units_holding_experts() -> None:
    g = _graph()
    assert [u.experts for u in g.chain] == [False, True, True, True]
    assert (g.moe.num_experts, g.moe.top_k) == (4, 2)


def test_ep_prices_the_units_holding_experts_and_leaves_the_dense_unit() -> None:
    one, two = _terms(), _terms(ep=2)
    assert two.units[0] == one.units[0]  # the dense first layer: no experts, no all-to-all
    assert two.expert_units == (False, True, True, True) and one.expert is None
    ex = two.expert
    for a, b in zip(one.units[1:], two.units[1:]):
        assert b.ep_comm_s > 0 and a.ep_comm_s == 0
        assert b.params < a.params  # half the experts on this rank
    assert ex.expert_params == pytest.approx(ex.all_expert_params / 2)
    # the all-to-all carries each token to its top-2 experts: the unit's input times top_k
    unit = _graph().chain[1]
    assert ex.a2a_bytes == pytest.approx(unit.input_bytes * 2 * 2)


def test_estimate_reports_the_chain_experts_and_their_memory() -> None:
    cluster = load_cluster("a100-80g")
    one, two = estimate_plan(_plan(), _graph(), cluster), estimate_plan(_plan(ep=2), _graph(), cluster)
    assert one.moe is None and two.moe["ep"] == 2
    per = _graph().moe.params_per_expert
    assert two.moe["expert_params_per_rank"] == pytest.approx(3 * 2 * per)  # 3 MoE units x 2 of 4 experts
    assert two.time_breakdown_s["ep_comm"] > 0 and "ep_comm" not in one.time_breakdown_s
    saved = 3 * 2 * per  # experts this rank no longer holds
    params_drop = one.memory_bytes["params"] - two.memory_bytes["params"]
    # fp32 parameters: ZeRO-0 trains under autocast over them (cost.zero.autocast_states)
    assert params_drop == pytest.approx(saved * 4, rel=1e-6)
    assert estimate_json(two)["moe"]["ep"] == 2


def test_a_stage_holds_the_experts_of_its_own_units_only() -> None:
    terms = _terms(ep=2, dp=4, pp=2)
    first, second = evaluate_chain(terms, [(0, 2), (2, 4)], 1.0, 1.0, 1.0).ranks
    # both stages hold two units; the first's dense unit carries no experts
    assert first.memory_bytes["params"] != second.memory_bytes["params"]
    dense, moe = terms.units[0], terms.units[1]
    assert first.params == pytest.approx(terms.base.pre.params + dense.params + moe.params)


def test_the_search_offers_ep_on_the_chain() -> None:
    from autopar.search.space import SearchSpace, enumerate_branches

    space = SearchSpace(num_gpus=8, gpus_per_node=8, global_batch=32, seq_len=16, micro_batches=(2,))
    rejected: Counter = Counter()
    assert {b.ep for b in enumerate_branches(_graph(), space, rejected)} >= {1, 2, 4}


def test_explain_counts_the_all_to_alls_of_the_moe_units_only() -> None:
    from autopar.explain.volume import communication_volume

    # stages [0, 2) and [2, 4): one and two MoE units
    plan = plan_from_dict({**copy.deepcopy(BASE), "parallel": {"dp": 4, "tp": 1, "pp": 2, "ep": 2,
                                                                "stages": [[0, 2], [2, 4]]}})
    first, second = communication_volume(plan, _graph(), load_cluster("a100-80g"))
    m = plan.num_microbatches

    def calls(stage, what):
        return sum(i.calls_per_step for i in stage.items if i.what.startswith(what))

    assert calls(first, "EP dispatch + combine (backward)") == 1 * m * 2
    assert calls(second, "EP dispatch + combine (backward)") == 2 * m * 2


def test_a_rank_does_the_weight_work_of_the_experts_it_holds_only() -> None:
    """The token-independent memory ops of a unit (weight casts, weight-gradient casts and sums)
    are proportional to the parameters a rank holds: under ep their experts' share shrinks by
    1 - 1/ep, whatever the micro-batch; ep 1 and a unit without experts change nothing."""
    from autopar.cost.compute import op_time_s
    from autopar.cost.expert import expert_weight_work_delta_s
    from autopar.graph.scaling import Shape

    g, cl = _graph(), load_cluster("a100-80g")
    region = g.chain[1].region
    fixed = {"fwd": 0.0, "bwd": 0.0}
    for b in (1, 4):
        shape = Shape(b=b, s_ratio=1.0, kv_ratio=1.0, t=1.0)
        for phase in fixed:
            fixed[phase] = sum(op_time_s(op, shape, cl, g.seq_len)[0] for op in g.regions[region].ops
                               if op.phase == phase and op.kind == "mem" and abs(op.bytes_exps.b) <= 0.25
                               and abs(op.bytes_exps.s) <= 0.25)
        assert fixed["bwd"] > 0  # the weight gradients' copies
        got = expert_weight_work_delta_s(g, cl, shape, 4, 0.8, region)
        assert got == pytest.approx((-fixed["fwd"] * 0.8 * 0.75, -fixed["bwd"] * 0.8 * 0.75))
        assert expert_weight_work_delta_s(g, cl, shape, 1, 0.8, region) == (0.0, 0.0)
    assert _terms(ep=2).expert.weights_bwd_s < 0


def test_explain_counts_a_block_list_s_recomputed_all_to_alls_per_block() -> None:
    """A block list under a per-stage recompute mix re-runs the all-to-alls of its fully recomputed
    blocks only (the same count as its other recomputed collectives), not of every block."""
    from autopar.explain.volume import communication_volume

    moe = Path(__file__).resolve().parents[2] / "examples" / "zoo" / "torch_moe.py"
    plan = plan_from_dict({**copy.deepcopy(BASE), "model": {"file": str(moe), "num_blocks": 4},
                           "training": {**BASE["training"], "seq_len": 32},
                           "parallel": {"dp": 8, "tp": 1, "pp": 1, "ep": 2,
                                        "recompute_blocks": [[3, 0, 1]]}})
    (stage,) = communication_volume(plan, build_graph(str(moe)), load_cluster("a100-80g"))
    m = plan.num_microbatches
    forward = next(i for i in stage.items if i.what.startswith("EP dispatch + combine (forward"))
    assert forward.calls_per_step == (4 + 1) * m * 2


def test_a_chain_whose_moe_kind_plan_shards_the_experts_prices_1_over_tp_of_them() -> None:
    """A chain with a TP plan per unit kind: the MoE kind's plan shards the experts' Linears
    (colwise / rowwise), so at tp 2 x ep 2 a rank holds half of its two experts' weights; the
    graph records that kind's plan, the block list's tp_styles staying empty."""
    import dataclasses

    from autopar.cost.expert import experts_tp_sharded

    g = _graph()
    assert not g.tp_styles and g.moe_tp_styles.get("ffn.experts.0.up") == "colwise"
    assert experts_tp_sharded(g)
    cfg = config_from_plan(_plan(dp=4, tp=2, ep=2))
    ex = build_chain_terms(g, load_cluster("a100-80g"), cfg).expert
    assert ex.all_expert_params == pytest.approx(g.moe.expert_params / 2)
    assert ex.expert_params == pytest.approx(g.moe.expert_params / 4)
    assert ex.dense_params > 0
    # a plan of the MoE kind that leaves the experts whole: every tp rank holds them whole
    whole = dataclasses.replace(g, moe_tp_styles={"ffn.router": "colwise"})
    assert not experts_tp_sharded(whole)
    ex = build_chain_terms(whole, load_cluster("a100-80g"), cfg).expert
    assert ex.all_expert_params == pytest.approx(g.moe.expert_params)


def test_grouped_stacks_are_all_the_experts_the_tp_plan_may_shard() -> None:
    """Experts held by several stacks (MoEFacts.paths): a plan sharding any of them shards the experts."""
    import dataclasses

    from autopar.cost.expert import experts_tp_sharded
    from autopar.graph.model_graph import MoEFacts

    g = _graph()
    moe = MoEFacts(num_experts=4, top_k=2, params_per_expert=10, experts_path="ffn.w_in", paths=("ffn.w_in", "ffn.w_out"))
    assert experts_tp_sharded(dataclasses.replace(g, moe=moe, moe_tp_styles={"ffn.w_out": "rowwise"}))
    assert not experts_tp_sharded(dataclasses.replace(g, moe=moe, moe_tp_styles={"ffn.up": "colwise"}))
