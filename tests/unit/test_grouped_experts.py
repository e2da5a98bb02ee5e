"""Stacked experts called with their rows already grouped by expert and the rows per expert (JetMoE's
``ParallelExperts``, ScatterMoE-style code) are found by that call, whatever the names: every stack
the MoE module calls so is one of the mixture's experts, and expert parallelism is offered
(spec/moe.py ``grouped_call``, ``MoESpec.grouped``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.modelfile import load_model_file
from autopar.spec import model_spec
from autopar.spec.moe import MoESpec, grouped_call

MODELS = Path(__file__).resolve().parents[1] / "dist" / "models"


def test_grouped_call_reads_rows_and_counts_by_position_or_keyword() -> None:
    rows = torch.zeros(10, 8)
    assert grouped_call((rows, [3, 0, 5, 2]), {}, 4) == ("0", "1")
    assert grouped_call((), {"sizes": (3, 0, 5, 2), "x": rows}, 4) == ("x", "sizes")
    assert grouped_call((rows,), {"sizes": torch.tensor([3, 0, 5, 2])}, 4) == ("0", "sizes")
    # a meta tensor of counts has no sum to read: the 2-D floating tensor beside it is the rows
    assert grouped_call((rows, torch.empty(4, dtype=torch.int64, device="meta")), {}, 4) == ("0", "1")


@pytest.mark.parametrize("args", [
    (torch.zeros(10, 8), [3, 0, 5, 1]),  # counts that do not sum to the rows
    (torch.zeros(10, 8), [5, 5]),  # not one count per expert
    (torch.zeros(10, 8), torch.tensor([3.0, 0.0, 5.0, 2.0])),  # floating: not counts
    (torch.zeros(2, 5, 8), [3, 0, 5, 2]),  # rows not grouped into one 2-D tensor
    (torch.zeros(10, 8),),  # no counts at all
])
def test_a_call_without_grouped_rows_and_counts_is_not_grouped(args) -> None:
    assert grouped_call(args, {}, 4) is None


def test_grouped_stacks_under_other_names_are_the_experts_and_ep_is_offered() -> None:
    spec = model_spec(load_model_file(MODELS / "grouped_moe.py"))
    moe = spec.moe
    assert moe is not None and moe.experts_kind == "stacked" and moe.call is None
    assert moe.grouped == (("moe.w_in", "grouped", "sizes"), ("moe.w_out", "grouped", "sizes"))
    assert moe.paths == ("moe.w_in", "moe.w_out")
    h, ff = 32, 48
    assert moe.params_per_expert == (h * ff + ff) + (ff * h + h)  # both stacks, each with its bias
    assert moe.router_name == "moe.gate" and moe.num_experts == 4 and moe.top_k == 2
    assert spec.support_reason("ep") is None


def test_experts_without_a_grouped_call_keep_one_path() -> None:
    moe = MoESpec(experts_path="mlp.experts", experts_kind="stacked", num_experts=4, top_k=2,
                  top_k_source="config", params_per_expert=10, router_name="mlp.gate")
    assert moe.paths == ("mlp.experts",)


def test_grouped_stacks_exchange_their_rows_and_results_each_and_are_priced_so() -> None:
    """Each grouped stack sends its rows and gets its results back under ep: the up projection
    (32 -> 48) and the down one (48 -> 32) exchange (32 + 48 + 48 + 32) / (2 x 32) = 2.5 times the
    bytes of one dispatch and combine of the tokens, which the cost model prices."""
    import dataclasses

    from autopar.cluster import load_cluster
    from autopar.cost.estimate import config_from_plan
    from autopar.cost.stage import build_terms
    from autopar.graph.measure import build_graph
    from autopar.plan import plan_from_dict

    path = MODELS / "grouped_moe.py"
    moe = model_spec(load_model_file(path)).moe
    assert moe.grouped_widths == ((32, 48), (48, 32)) and moe.exchange_factor == pytest.approx(2.5)
    g = build_graph(str(path))
    assert g.moe.exchange_factor == pytest.approx(2.5) and g.moe.paths == ("moe.w_in", "moe.w_out")
    cfg = config_from_plan(plan_from_dict({
        "version": 1, "model": {"file": str(path), "num_blocks": 4},
        "cluster": {"profile": "a100-80g", "num_gpus": 2, "gpus_per_node": 8},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 16, "dtype": "bf16",
                     "optimizer": "adamw"},
        "parallel": {"dp": 2, "tp": 1, "pp": 1, "ep": 2}}))
    cl = load_cluster("a100-80g")
    grouped = build_terms(g, cl, cfg).expert
    once = build_terms(dataclasses.replace(g, moe=dataclasses.replace(g.moe, exchange_factor=1.0)), cl, cfg).expert
    assert grouped.a2a_bytes == pytest.approx(2.5 * once.a2a_bytes)
    assert grouped.a2a_fwd_s > once.a2a_fwd_s
