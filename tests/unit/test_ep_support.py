"""Expert parallelism is one predicate (autopar.spec.support ``ep``): for every mixture-of-experts
model of the zoo, "the search offers ep" <=> "the executor's preflight accepts an ep plan" <=>
"estimate accepts it", and where all three refuse, they give the same reason. The experts are found
by behaviour (a router's top-k among expert weights): a ModuleList, stacked 3-D weights with or
without biases, weights packed along their rows, beside a shared expert or not.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import zoo_lib  # noqa: E402

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# zoo model -> (experts kind found, ep offered); None: no experts in one repeated block
MOE_ZOO = {
    "torch_moe": ("ModuleList", True),
    "torch_moe_stacked": ("stacked", True),  # 3-D weights with biases, a shared expert beside them
    "hf_mixtral": ("stacked", True),
    "hf_qwen2_moe": ("stacked", True),  # a gated shared expert
    "hf_gpt_oss": ("stacked", True),  # a biased router, per-expert biases, other argument names
    "hf_dbrx": ("stacked", True),  # weights packed as (experts x ffn, hidden) rows
    "hf_jetmoe": ("stacked", True),  # stacks called with rows grouped by expert and the rows per expert
    "hf_deepseek_v3": ("stacked", True),  # a chain: a dense first block, then units holding the experts
    "bare_pos_gpt": (None, False),  # dense
}


def _plan(path: Path, num_blocks: int, seq: int):
    from autopar.plan import plan_from_dict

    return plan_from_dict({
        "version": 1, "model": {"file": str(path), "num_blocks": num_blocks},
        "cluster": {"profile": "a100-80g", "num_gpus": 2, "gpus_per_node": 8},
        "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": seq, "dtype": "bf16",
                     "optimizer": "adamw"},
        "parallel": {"dp": 2, "tp": 1, "pp": 1, "ep": 2},
    })


@pytest.mark.parametrize("name", list(MOE_ZOO))
def test_search_offers_ep_exactly_where_preflight_and_estimate_accept_it(name, tmp_path):
    if name.startswith("hf_") and not HAS_TRANSFORMERS:
        pytest.skip("transformers not installed")
    from autopar.cost.estimate import check_plan_against_model
    from autopar.errors import AutoparError
    from autopar.executor.runtime.checks import preflight
    from autopar.graph import build_graph
    from autopar.modelfile import load_model_file
    from autopar.search.space import SearchSpace, enumerate_branches
    from autopar.spec import model_spec

    kind, offered_expected = MOE_ZOO[name]
    mf = load_model_file(zoo_lib.with_size(zoo_lib.zoo_models([name])[0].path, "tiny", tmp_path))
    spec = model_spec(mf)
    assert (spec.moe.experts_kind if spec.moe else None) == kind, spec.moe
    graph = build_graph(mf)
    space = SearchSpace(num_gpus=4, gpus_per_node=8, global_batch=8, seq_len=mf.seq_len or 1, micro_batches=(1,))
    rejected: Counter = Counter()
    offered = any(b.ep > 1 for b in enumerate_branches(graph, space, rejected))
    plan = _plan(mf.path, spec.num_blocks, mf.seq_len or 1)
    try:
        preflight(plan, mf, world_size=2)
        preflight_reason = None
    except AutoparError as exc:
        preflight_reason = str(exc)
    try:
        check_plan_against_model(plan, graph)
        estimate_reason = None
    except AutoparError as exc:
        estimate_reason = str(exc)
    assert offered == offered_expected, (name, spec.support_reason("ep"))
    assert (preflight_reason is None) == offered, preflight_reason
    assert (estimate_reason is None) == offered, estimate_reason
    reason = spec.support_reason("ep")
    assert (reason is None) == offered
    if reason is not None:
        assert reason in preflight_reason and reason in estimate_reason
        if spec.moe is not None or spec.expert_units:  # a model with experts says why in the plan's rejected line
            assert rejected[f"ep: {reason}"] == 1


def test_a_chain_whose_later_units_hold_experts_shards_those_units(tmp_path):
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers not installed")
    from autopar.graph import build_graph
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    mf = load_model_file(zoo_lib.with_size(zoo_lib.zoo_models(["hf_deepseek_v3"])[0].path, "tiny", tmp_path))
    spec = model_spec(mf)
    assert spec.expert_units == spec.moe_units == ("model.layers.1", "model.layers.2", "model.layers.3")
    assert spec.moe.call is not None and spec.support_reason("ep") is None
    graph = build_graph(mf)
    assert [u.experts for u in graph.chain] == [False, True, True, True]
    assert graph.moe.num_experts == 4 and graph.moe.top_k == 2


def test_stacked_experts_are_called_with_rows_indices_and_weights_by_position_or_keyword():
    import torch

    from autopar.spec.moe import routed_call

    rows, idx, w = torch.empty(6, 8), torch.zeros(6, 2, dtype=torch.long), torch.empty(6, 2)
    assert routed_call((rows, idx, w), {}, 2) == ("0", "1", "2")
    assert routed_call((rows,), {"routing_weights": w, "router_indices": idx}, 2) == ("0", "router_indices", "routing_weights")
    assert routed_call((rows.view(2, 3, 8), idx, w), {}, 2) == ("0", "1", "2")  # rows as (batch, seq, width)
    assert routed_call((rows, torch.empty(6, 4)), {}, 2) is None  # sorted rows and counts: not this call
