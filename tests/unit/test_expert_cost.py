"""Issue 15: expert parallelism in the plan, the cost model, the search and explain.

The cost facts are checked on the zoo's plain-torch MoE (tiny: no transformers needed); the FLOPs
formula on Mixtral-8x7B's dimensions (needs transformers).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import Counter
from pathlib import Path

import pytest
import yaml

from autopar.cluster import load_cluster
from autopar.cost.estimate import estimate_json, estimate_plan
from autopar.cost.expert import check_ep, expert_flops_per_token
from autopar.errors import PlanError
from autopar.graph.measure import build_graph
from autopar.plan import dump_plan, parse_plan, plan_from_dict

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"
TORCH_MOE = ZOO / "torch_moe.py"

BASE = {
    "version": 1,
    "model": {"file": str(TORCH_MOE), "num_blocks": 4},
    "cluster": {"profile": "a100-80g", "num_gpus": 8, "gpus_per_node": 8},
    "training": {"global_batch_size": 64, "micro_batch_size": 2, "seq_len": 32, "dtype": "bf16", "optimizer": "adam"},
    "parallel": {"dp": 8, "tp": 1, "pp": 1},
}


def _plan(**parallel):
    data = copy.deepcopy(BASE)
    data["parallel"].update(parallel)
    return plan_from_dict(data)


@functools.lru_cache(maxsize=None)
def _graph():
    return build_graph(str(TORCH_MOE))


# ---------------------------------------------------------------- plan v1: ep


def test_ep_is_optional_and_old_plans_are_written_unchanged() -> None:
    plan = _plan()
    assert plan.parallel.ep == 1
    assert "ep" not in yaml.safe_load(dump_plan(plan))["parallel"]  # dense plans: not a byte changes
    again = parse_plan(dump_plan(_plan(ep=4)))
    assert again.parallel.ep == 4 and yaml.safe_load(dump_plan(again))["parallel"]["ep"] == 4


@pytest.mark.parametrize("parallel,needle", [
    ({"ep": 3}, "parallel.ep = 3 does not divide dp x cp = 8"),
    ({"ep": 0}, "parallel.ep must be >= 1"),
    ({"ep": "2"}, "parallel.ep must be an integer"),
])
def test_bad_ep_is_a_one_line_plan_error(parallel, needle) -> None:
    with pytest.raises(PlanError) as info:
        _plan(**parallel)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_ep_legality_names_the_reason() -> None:
    g = _graph()
    assert g.moe is not None and (g.moe.num_experts, g.moe.top_k) == (4, 2)
    from autopar.layout import Layout

    dp8, dp6 = Layout(dp=8), Layout(dp=6)
    assert check_ep(g, 1, dp8) is None and check_ep(g, 4, dp8) is None
    assert "does not divide the model's 4 experts" in check_ep(g, 8, dp8)
    assert "does not divide dp x cp = 6" in check_ep(g, 4, dp6)
    dense = dataclasses.replace(g, moe=None)
    assert "has no experts in its blocks" in check_ep(dense, 2, dp8)
    refused = dataclasses.replace(g, support={**g.support, "ep": "the blocks differ"})  # spec/support.py's ep
    assert check_ep(refused, 2, dp8) == "torch_moe: the blocks differ"
    with pytest.raises(PlanError, match="parallel.ep = 8 is not possible"):
        estimate_plan(_plan(ep=8), g, load_cluster("a100-80g"))


# ---------------------------------------------------------------- the cost model


def test_expert_states_are_sharded_by_ep_and_flops_do_not_change() -> None:
    g, cl = _graph(), load_cluster("a100-80g")
    moe = g.moe
    e1 = estimate_plan(_plan(ep=1), g, cl)
    e4 = estimate_plan(_plan(ep=4), g, cl)
    # ZeRO-0 (DDP, under autocast: cost.zero.autocast_states): fp32 params, their own master, fp32
    # grads and Adam's 8 bytes of moments, every expert byte held by 1/ep of the ranks
    held_less = g.num_blocks * moe.expert_params * (1 - 1 / 4)
    assert e1.memory_bytes["params"] - e4.memory_bytes["params"] == pytest.approx(held_less * 4)
    assert e1.memory_bytes["optimizer"] - e4.memory_bytes["optimizer"] == pytest.approx(held_less * 8)
    # the same model FLOPs per step (MFU's numerator): ep moves tokens, it adds no expert compute
    assert e1.mfu * e1.step_time_s == pytest.approx(e4.mfu * e4.step_time_s)
    assert e1.moe is None and "moe" not in estimate_json(e1) and "ep_comm" not in e1.time_breakdown_s


def test_zero3_shards_expert_states_over_the_edp_ranks_only() -> None:
    g, cl = _graph(), load_cluster("a100-80g")
    e = estimate_plan(_plan(ep=4, zero=3), g, cl)
    dense_block = g.params["block"].count - g.moe.expert_params
    dense = g.params["pre"].count + g.params["post"].count + g.params["loss"].count + g.num_blocks * dense_block
    experts = g.num_blocks * g.moe.expert_params / 4  # this rank's experts, sharded over dp / ep = 2
    # FSDP2's fp32 shards (cost.zero.fp32_shards): 4 bytes per parameter over each group's ranks
    assert e.memory_bytes["params"] == pytest.approx(dense * 4 / 8 + experts * 4 / 2)


def test_all_to_all_volume_and_link() -> None:
    g, cl = _graph(), load_cluster("a100-80g")
    plan = _plan(ep=4)
    m = estimate_plan(plan, g, cl).moe
    tokens_bytes = 2 * 32 * 64 * 2  # micro-batch 2 x 32 tokens x width 64 x bf16
    micro_batches = 64 // (8 * 2)
    sent = 4 * tokens_bytes * 2 * micro_batches * g.num_blocks * 3 / 4  # 4 all-to-alls of top-2 rows, 3/4 leave
    assert m["a2a_bytes_per_step"] == pytest.approx(sent)
    assert m["a2a_link"] == "nvlink" and m["ep"] == 4 and m["a2a_s_per_step"] > 0
    est = estimate_plan(plan, g, cl)
    assert est.time_breakdown_s["ep_comm"] >= m["a2a_s_per_step"]
    assert estimate_json(est)["moe"] == m
    # with 2 GPUs per node an ep group of 4 spans two nodes: the network
    small_nodes = dataclasses.replace(cl, gpus_per_node=2)
    assert estimate_plan(plan, g, small_nodes).moe["a2a_link"] == "network"


def test_all_to_all_across_nodes_rides_each_rank_own_rail() -> None:
    """An all-gather across nodes shares each byte over the node's k rails (bus bandwidth
    min(NVLink, k x rail)); an all-to-all cannot: the (n - k)/n of a rank's message bound for
    other nodes leaves through its own 50 GB/s rail. Inside a node both use NVLink's figure."""
    from autopar.cost.comm import collective_time_s, group_link

    cl = load_cluster("h100-80g")
    m = 8 * 2**30
    inter, intra = cl.inter_node, cl.intra_node
    across = group_link(cl, 16, 1)  # 2 nodes x 8
    assert not across.intra_node and across.bandwidth_bytes_per_s == pytest.approx(370e9)
    eff = inter.efficiency(m / 16)
    assert collective_time_s("all_gather", m, across) == pytest.approx(15 / 16 * m / (370e9 * eff) + 15 * inter.latency_s)
    assert collective_time_s("all_to_all", m, across) == pytest.approx(8 / 16 * m / (50e9 * eff) + 15 * inter.latency_s)
    one_rail = group_link(cl, 8, 8)  # one member per node: the same figure either way
    assert collective_time_s("all_to_all", m, one_rail) == pytest.approx(collective_time_s("all_gather", m, one_rail))
    inside = group_link(cl, 8, 1)
    assert collective_time_s("all_to_all", m, inside) == pytest.approx(
        7 / 8 * m / (370e9 * intra.efficiency(m / 8)) + 7 * intra.latency_s)


def test_expert_gemms_are_priced_at_their_ep_shape() -> None:
    """Under ep a rank runs E / ep experts on ep times the rows each: the zoo MoE's 12 forward and
    24 backward expert GEMMs (3 Linears of 64 <-> 96 per expert, 16 rows per expert per sample)
    become 3 and 6 GEMMs of 4 x the rows; the router's and attention's GEMMs keep their shape."""
    from autopar.cost.expert import expert_gemm_delta_s
    from autopar.graph.scaling import Shape

    g, cl = _graph(), load_cluster("a100-80g")
    b, ep = 2, 4
    rows = 16 * b

    def gemm_s(m, n, k):
        return 2 * m * n * k / (cl.peak_flops * cl.gemm(m, n, k)) + cl.kernel_overhead_s

    def change(count, dims):  # dims with "t" where the expert's rows go
        now = [rows if d == "t" else d for d in dims]
        then = [rows * ep if d == "t" else d for d in dims]
        return count * (gemm_s(*then) / ep - gemm_s(*now))

    fwd = change(8, ("t", 96, 64)) + change(4, ("t", 64, 96))
    bwd = (change(8, ("t", 64, 96)) + change(4, ("t", 96, 64))  # input gradients
           + change(8, (96, 64, "t")) + change(4, (64, 96, "t")))  # weight gradients: rows are k
    got = expert_gemm_delta_s(g, cl, Shape(b=b, s_ratio=1.0, kv_ratio=1.0, t=1.0), ep)
    assert got == pytest.approx((fwd, bwd), rel=1e-9)
    assert fwd < 0 and bwd < 0  # fewer, larger GEMMs
    assert expert_gemm_delta_s(g, cl, Shape(b=b, s_ratio=1.0, kv_ratio=1.0, t=1.0), 1) == (0.0, 0.0)
    e1, e4 = (estimate_plan(_plan(ep=n), g, cl) for n in (1, 4))  # BASE: micro-batch 2
    assert e4.time_breakdown_s["compute"] < e1.time_breakdown_s["compute"]


def test_imbalance_slows_ep_plans_only() -> None:
    g, cl = _graph(), load_cluster("a100-80g")
    flat = [estimate_plan(_plan(ep=1), g, cl, moe_imbalance=f).step_time_s for f in (1.0, 1.5)]
    assert flat[0] == flat[1]
    balanced, skewed = (estimate_plan(_plan(ep=4), g, cl, moe_imbalance=f) for f in (1.0, 1.5))
    assert skewed.step_time_s > balanced.step_time_s
    assert balanced.moe["imbalance_s_per_step"] == 0.0 and skewed.moe["imbalance_s_per_step"] > 0
    assert skewed.moe["a2a_bytes_per_step"] == pytest.approx(1.5 * balanced.moe["a2a_bytes_per_step"])


def test_mixtral_8x7b_flops_per_token_are_the_top2_dense_equivalent(tmp_path) -> None:
    """Forward FLOPs per token of a Mixtral-8x7B block = attention + router + top_k = 2 SwiGLU
    experts (not 8): 2 d (2 d + 2 kv) + 4 s d + 2 d E + 2 x 3 x 2 d f. Training FLOPs per token
    of the whole model = 3 x (L x block + head 2 d V): 82.9 GFLOP at L = 32 -- what a dense model
    with a 2 x 14336-wide MLP would do, plus the router. Traced with 2 of the 32 layers (the
    per-block FLOPs do not depend on the depth)."""
    pytest.importorskip("transformers")
    text = (ZOO / "hf_mixtral.py").read_text().replace('SIZE = "tiny"', 'SIZE = "full"')
    path = tmp_path / "mixtral_8x7b_2layers.py"
    path.write_text(text.replace("num_hidden_layers=32", "num_hidden_layers=2"))
    g = build_graph(str(path))
    d, f, heads, kv_heads, e, k, s, v = 4096, 14336, 32, 8, 8, 2, 4096, 32000
    kv = kv_heads * d // heads
    attention = 2 * d * (2 * d + 2 * kv) + 4 * s * d
    block = attention + 2 * d * e + k * 3 * 2 * d * f
    per_token = g.model_flops_per_sample() / s
    assert per_token == pytest.approx(3 * (2 * block + 2 * d * v), rel=0.02)
    assert expert_flops_per_token(g) == k * 3 * 2 * d * f  # the cost model's expert share: top-2
    full = 3 * (32 * block + 2 * d * v)
    assert full == pytest.approx(82.9e9, rel=0.01)
    all_eight = 3 * (32 * (attention + 2 * d * e + e * 3 * 2 * d * f) + 2 * d * v)
    assert per_token < 0.5 * (3 * (2 * (attention + 2 * d * e + e * 3 * 2 * d * f) + 2 * d * v)) < all_eight


# ---------------------------------------------------------------- search and explain


def test_search_offers_ep_where_legal_and_records_it() -> None:
    from autopar.search.space import SearchSpace, enumerate_branches

    g = _graph()
    rejected: Counter = Counter()
    space = SearchSpace(num_gpus=8, gpus_per_node=8, global_batch=64, seq_len=32, micro_batches=(1, 2))
    branches = list(enumerate_branches(g, space, rejected))
    eps = {(b.tp, b.pp, b.dp * b.cp, b.ep) for b in branches}
    assert {b.ep for b in branches} == {1, 2, 4}
    assert all(ep == 1 or dpcp % ep == 0 for tp, pp, dpcp, ep in eps)
    # pp x ep and tp x ep run (tests/dist/test_expert_parallel.py)
    assert any(ep > 1 and pp > 1 for tp, pp, dpcp, ep in eps) and any(ep > 1 and tp > 1 for tp, pp, dpcp, ep in eps)
    assert rejected["ep does not divide dp x cp (x tp under sp)"] > 0
    only = SearchSpace(num_gpus=8, gpus_per_node=8, global_batch=64, seq_len=32, micro_batches=(1,), ep_degrees=(4,))
    assert {b.ep for b in enumerate_branches(g, only, Counter())} == {4}


def test_plan_cli_ep_constraint_and_imbalance(tmp_path, capsys) -> None:
    from autopar.commands.main import main

    out = tmp_path / "p.yaml"
    assert main(["plan", str(TORCH_MOE), "--gpus", "8", "--ep", "4", "--moe-imbalance", "1.2", "-o", str(out),
                 "--quiet", "--no-cache"]) == 0
    text = capsys.readouterr().out
    assert " ep*" in text  # the ep column, starred: fixed by the user
    plan = parse_plan(out.read_text())
    assert plan.parallel.ep == 4 and yaml.safe_load(out.read_text())["prediction"]["moe"]["imbalance"] == 1.2
    assert main(["plan", str(TORCH_MOE), "--gpus", "8", "--moe-imbalance", "0.5", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "autopar: error: --moe-imbalance must be in [1, 64]" in err


def test_estimate_cli_prices_the_imbalance_it_is_given(tmp_path, capsys) -> None:
    import json

    from autopar.commands.main import main

    plan = tmp_path / "ep.yaml"
    plan.write_text(dump_plan(_plan(ep=4)))
    outs = {}
    for f in ("1", "1.3"):
        assert main(["estimate", str(plan), "--json", "--moe-imbalance", f, "--no-cache"]) == 0
        outs[f] = json.loads(capsys.readouterr().out)
    balanced, skewed = outs["1"], outs["1.3"]
    assert balanced["moe"]["imbalance"] == 1.0 and skewed["moe"]["imbalance"] == 1.3
    assert skewed["step_time_s"] > balanced["step_time_s"]
    assert skewed["moe"]["a2a_bytes_per_step"] == pytest.approx(1.3 * balanced["moe"]["a2a_bytes_per_step"])
    assert balanced["moe"]["expert_gemm_s_per_step"] < 0  # 16-row expert GEMMs become 64-row ones
    # the same figures estimate_plan gives (the JSON keys of before are all still there)
    direct = estimate_json(estimate_plan(_plan(ep=4), _graph(), load_cluster("a100-80g"), moe_imbalance=1.3))
    assert skewed["step_time_s"] == pytest.approx(direct["step_time_s"]) and set(direct) == set(skewed)
    assert main(["estimate", str(plan), "--moe-imbalance", "1.3", "--no-rank", "--no-cache"]) == 0
    text = capsys.readouterr().out
    assert "experts  ep 4 over nvlink, priced at routing imbalance 1.3:" in text
    assert main(["estimate", str(plan), "--moe-imbalance", "0.9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "autopar: error: --moe-imbalance must be in [1, 64]" in err


def test_explain_shows_all_to_all_volume_and_the_imbalance_effect() -> None:
    from autopar.explain.explanation import explain_plan, format_explanation

    g, cl = _graph(), load_cluster("a100-80g")
    ex = explain_plan(_plan(ep=4), g, cl, moe_imbalance=1.2)
    text = format_explanation(ex)
    assert "== experts: 4 per block, top-2, ep 4 ==" in text
    assert "EP dispatch + combine (forward)" in text and "sent per GPU per step" in text
    factors = [f for f, _ in ex.imbalance_effect]
    assert factors == [1.0, 1.1, 1.2, 1.25, 1.5]
    times = [e.step_time_s for _, e in ex.imbalance_effect]
    assert times == sorted(times) and times[0] < times[-1]
    assert "1.2 *" in text  # the factor the plan is priced at
    assert ex.estimate.step_time_s == times[2]
    dense = format_explanation(explain_plan(_plan(ep=1), g, cl))
    assert "routing imbalance costs nothing at ep 1" in dense


def test_expert_tensor_parallel_shards_the_experts_over_tp_too() -> None:
    """The zoo MoE's TP plan shards its expert Linears (colwise / rowwise: expert tensor
    parallelism), so at tp 2 x ep 2 a rank holds half of its two experts' weights; HF-style
    stacked experts outside the TP plan stay whole on every tp rank."""
    from autopar.cost.estimate import config_from_plan
    from autopar.cost.expert import experts_tp_sharded
    from autopar.cost.stage import build_terms

    g, cl = _graph(), load_cluster("a100-80g")
    assert experts_tp_sharded(g)
    ex = build_terms(g, cl, config_from_plan(_plan(dp=4, tp=2, ep=2))).expert
    assert ex.all_expert_params == pytest.approx(g.moe.expert_params / 2)
    assert ex.expert_params == pytest.approx(g.moe.expert_params / 4)
    assert ex.dense_params == pytest.approx(g.params["block"].per_rank(2) - g.moe.expert_params / 2)
    assert not experts_tp_sharded(dataclasses.replace(g, tp_styles={}))


def test_run_preflight_refuses_ep_on_a_dense_model() -> None:
    from autopar.errors import AutoparError
    from autopar.executor.runtime.checks import preflight
    from autopar.modelfile import load_model_file

    mf = load_model_file(ZOO / "bare_pos_gpt.py")
    data = copy.deepcopy(BASE)
    data["model"] = {"file": str(mf.path), "num_blocks": 4}
    data["parallel"] = {"dp": 8, "tp": 1, "pp": 1, "ep": 2}
    data["training"]["seq_len"] = mf.seq_len
    with pytest.raises(AutoparError, match="expert parallelism cannot run on .*: no mixture of experts in the blocks"):
        preflight(plan_from_dict(data), mf)


def test_run_refuses_checkpoints_of_ep_plans(tmp_path, capsys) -> None:
    from autopar.commands.main import main

    data = copy.deepcopy(BASE)
    data["cluster"]["num_gpus"], data["parallel"] = 2, {"dp": 2, "tp": 1, "pp": 1, "ep": 2}
    data["training"].update(global_batch_size=4, micro_batch_size=1, dtype="fp32")
    plan = tmp_path / "ep.yaml"
    plan.write_text(dump_plan(plan_from_dict(data)))
    assert main(["run", str(plan), "--steps", "1", "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "checkpoints of expert-parallel plans (ep > 1) are not supported yet" in err and err.count("\n") == 1
