"""A block's backward peak under expert parallelism (cost.compute.peak_with_grads, cost/expert.py
``grads_share``): FSDP2 holds a block's parameter gradients until its post-backward, and at ep > 1
a rank makes only its dense ones and its E / ep experts'. The backward op that peaks must be picked
at that share: the trace's own pick (the block's end, every gradient made and every activation
freed) fell below zero once 7/8 of its gradients were taken away, and Mixtral-8x7B's stages at
ep 8 rehearsed 0.5 GiB above their price."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest

from autopar.cluster import load_cluster
from autopar.cost.compute import RegionTime, peak_with_grads
from autopar.cost.estimate import config_from_plan
from autopar.cost.expert import grads_share
from autopar.cost.stage import build_terms
from autopar.cost.zero import holds_unit_grads
from autopar.graph.measure import build_graph
from autopar.plan import plan_from_dict

TORCH_MOE = Path(__file__).resolve().parents[2] / "examples" / "zoo" / "torch_moe.py"


def _rt(candidates: tuple[tuple[float, float], ...], rise: float = 0.0) -> RegionTime:
    top = max(candidates, key=lambda v: v[0] + v[1])
    return RegionTime(fwd_s=0.0, bwd_s=0.0, core_fwd_s=0.0, bwd_gemm_s=0.0, fwd_flops=0.0, bwd_flops=0.0,
                      saved_bytes=0.0, core_saved_bytes=0.0, fwd_rise_bytes=rise,
                      peak_with_grads_bytes=max(0.0, rise, top[0] + top[1]), bwd_grads_bytes=top[1],
                      grads_candidates=candidates)


def test_the_peak_op_is_picked_again_at_the_ranks_share_of_gradients() -> None:
    # (temporaries less the activations freed by then, gradients made by then)
    end, early = (-50.0, 100.0), (40.0, 10.0)
    rt = _rt((end, early))
    assert peak_with_grads(rt) == (50.0, 100.0)  # every gradient: the block's end peaks
    # a quarter of them (ep 4 over experts only): the early op, never the end's 25 - 50 < 0
    assert peak_with_grads(rt, 0.25) == pytest.approx((42.5, 2.5))
    # forward's rise above every backward candidate: no gradients at the peak
    assert peak_with_grads(_rt((end, early), rise=60.0), 0.25) == (60.0, 0.0)


def test_a_share_of_one_keeps_the_traced_pick() -> None:
    rt = _rt(((-5.0, 30.0), (10.0, 0.0)))
    assert peak_with_grads(rt, 1.0) == (rt.peak_with_grads_bytes, rt.peak_grads_bytes)


@functools.lru_cache(maxsize=None)
def _graph():
    return build_graph(str(TORCH_MOE))


def _terms(ep: int):
    data = {"version": 1, "model": {"file": str(TORCH_MOE), "num_blocks": 4},
            "cluster": {"profile": "h100-80g", "num_gpus": 8, "gpus_per_node": 8},
            "training": {"global_batch_size": 64, "micro_batch_size": 2, "seq_len": 32, "dtype": "bf16",
                         "optimizer": "adam"},
            "parallel": {"dp": 4, "tp": 1, "pp": 2, "zero": 1, "pp_schedule": "1f1b", "ep": ep,
                         "stages": [[0, 2], [2, 4]]}}
    plan = plan_from_dict(copy.deepcopy(data))
    cfg, cluster = config_from_plan(plan), load_cluster("h100-80g")
    assert holds_unit_grads(cfg, cluster)  # ZeRO-1 under a pipeline: FSDP2 holds each block's gradients
    return build_terms(_graph(), cluster, cfg), cfg


def test_fewer_experts_per_rank_never_raise_the_peak_nor_drop_it_below_the_temporaries() -> None:
    graph = _graph()
    peaks = []
    for ep in (1, 2, 4):
        terms, cfg = _terms(ep)
        share = grads_share(graph, cfg, terms.block.params if ep == 1 else
                            graph.params["block"].per_rank(cfg.tp))
        assert (share == 1.0) == (ep == 1) and 0.0 < share <= 1.0
        peaks.append(terms.block.peak_bytes)
        assert terms.block.peak_bytes >= 0.0
        assert terms.block.peak_grads_bytes <= share * graph.params["block"].per_rank(1) * cfg.dtype_bytes + 1.0
    assert peaks[0] >= peaks[1] >= peaks[2]
    # the gradients priced at ep 4 are those of the rank's own experts and dense weights
    four, cfg = _terms(4)
    rt_share = grads_share(graph, cfg, graph.params["block"].per_rank(1))
    experts = graph.moe.expert_params
    dense = graph.params["block"].per_rank(1) - experts
    assert rt_share == pytest.approx((dense + experts / 4) / (dense + experts))


def test_selective_recompute_meets_the_gradients_of_the_rank_s_share() -> None:
    # the core's re-run meets the gradients made behind it: at ep > 1 those of the rank's share
    from autopar.cost.compute import bwd_grads_at

    rt = _rt(((-50.0, 100.0), (40.0, 10.0)))
    assert bwd_grads_at(rt) == 100.0
    assert bwd_grads_at(rt, 0.25) == pytest.approx(2.5)  # the early op peaks there: its gradients
