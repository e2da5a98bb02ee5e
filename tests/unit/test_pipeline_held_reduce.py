"""Under a pipeline, FSDP2's last reduce-scatter input of a micro-batch's backward outlives it:
torch pipelining runs each backward with is_last_backward off, so the final callback keeps the
input until the next micro-batch's first reduce, and that micro-batch's first block to run backward
meets it beside every activation (StageTerms.first_backward_held_bytes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_unit_grad_peaks import _terms


def test_zero3_under_a_pipeline_holds_the_last_reduced_units_fp32_gradients() -> None:
    terms, _ = _terms(dp=2, pp=2, zero=3, pp_schedule="1f1b")
    assert terms.pipeline_held_reduce_bytes_per_param == 4  # fp32 reduce input
    bare = replace(terms, held_reduce_bytes_per_param=0.0)
    # the last stage: the root unit's (head, its tied copy) gradients; the first: the embedding's
    head = terms.post.params + terms.tied_params
    assert terms.first_backward_held_bytes(False, True) == pytest.approx(4 * head)
    assert terms.first_backward_held_bytes(True, False) == pytest.approx(4 * terms.pre.params)
    # never less than without it, and on a rank where that phase peaks, more by exactly the excess
    for rank in (0, 1):
        assert terms.rank_other_bytes(rank, 1, loss=False) >= bare.rank_other_bytes(rank, 1, loss=False)
    base = (terms.transient_bytes + terms.block.peak_bytes - terms.post.act_bytes + terms.root_grad_bytes
            + terms.root_bytes(False, True) + terms.stage_output_bytes
            + terms.config.num_microbatches * terms.pipeline_buffer_bytes)
    assert terms.rank_other_bytes(1, 1, loss=False) >= base + 4 * head - 1e-6 * base


@pytest.mark.parametrize("par", [
    {"dp": 8, "zero": 3},  # no pipeline: the final callback releases it after every backward
    {"dp": 2, "pp": 2, "zero": 1, "pp_schedule": "1f1b"},  # reduced once, after the last backward
    {"dp": 2, "pp": 2, "zero": 0, "pp_schedule": "1f1b"},  # replicate: likewise
])
def test_nothing_outlives_a_backward_elsewhere(par: dict) -> None:
    terms, _ = _terms(**par)
    assert terms.pipeline_held_reduce_bytes_per_param == 0.0


def test_a_layer_chain_stage_meets_it_at_its_last_unit() -> None:
    """The same input in a layer chain (cost/chain.py): the stage's last unit runs backward first and
    meets the previous micro-batch's last reduce-scatter input -- the root unit's gradients on an
    edge rank, else the stage's first unit's -- and the search's O(1) pricer agrees."""
    from collections import Counter

    from test_chain import _resnet_graph

    from autopar.cluster import load_cluster
    from autopar.cost.chain import build_chain_terms, stage_load, stage_memory
    from autopar.search.chain_search import StagePricer
    from autopar.search.space import SearchSpace, enumerate_configs

    g = _resnet_graph()
    space = SearchSpace(num_gpus=6, gpus_per_node=6, global_batch=24, seq_len=1, micro_batches=(4,))
    configs = {(c.dp, c.pp, c.zero, c.schedule): c for c in enumerate_configs(g, space, Counter()) if c.tp == 1}
    cfg = configs[(2, 3, 3, "1f1b")]
    terms = build_chain_terms(g, load_cluster("h100-80g"), cfg)
    t = terms.base
    assert t.pipeline_held_reduce_bytes_per_param == 4
    for r, (a, b) in enumerate(((0, 1), (1, 3), (3, g.num_blocks))):
        load = stage_load(terms, a, b, r)
        root = (t.pre.params if r == 0 else 0.0) + (t.post.params + t.tied_params if r == 2 else 0.0)
        held = 4 * (root if root > 0 else terms.units[a].params)
        assert held > 0
        assert load.first_backward_bytes == pytest.approx(
            terms.unit_transient_bytes[b - 1] + terms.units[b - 1].peak_bytes + held)
        assert StagePricer(terms).load(a, b, r).first_backward_bytes == pytest.approx(load.first_backward_bytes)
        bare = replace(load, first_backward_bytes=0.0)
        assert stage_memory(terms, load, r)["other"] >= stage_memory(terms, bare, r)["other"]
    # the middle rank holds no edge: its first unit's gradients, and its other memory counts that phase
    mid = stage_load(terms, 1, 3, 1)
    floor = t.root_bytes(False, False) + mid.first_backward_bytes + cfg.num_microbatches * mid.buffer_bytes + t.reserve_bytes
    assert stage_memory(terms, mid, 1)["other"] >= floor * (1 - 1e-9)
    big = replace(mid, first_backward_bytes=1e12)  # a phase of the max: where it is largest, it is the peak
    assert stage_memory(terms, big, 1)["other"] == pytest.approx(floor - mid.first_backward_bytes + 1e12)
    one = build_chain_terms(g, load_cluster("h100-80g"), configs[(2, 3, 1, "1f1b")])
    assert stage_load(one, 1, 3, 1).first_backward_bytes == 0.0  # ZeRO-1 reduces once, after the last backward
