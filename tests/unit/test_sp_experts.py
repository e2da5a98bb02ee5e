"""Sequence parallelism through mixture-of-experts layers (Megatron-Core's MoE parallel folding):
each tp rank routes its own sequence shard, the ep ranks are drawn from dp x cp x tp (tp first),
and the router's and experts' gradients are reduced over the tp ranks too. Here: what the spec
offers, what the search enumerates, and how the cost model prices the shard; the runs against one
rank are in tests/dist/test_expert_parallel.py."""

from __future__ import annotations

import functools
import sys
from collections import Counter
from pathlib import Path

import pytest

from autopar.cluster import load_cluster
from autopar.cost.estimate import estimate_plan
from autopar.errors import PlanError
from autopar.graph.measure import build_graph
from autopar.modelfile import load_model_file
from autopar.plan import plan_from_dict
from autopar.spec import model_spec

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"


@functools.lru_cache(maxsize=None)
def _mixtral(tmp: str) -> Path:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ZOO.parents[1] / "benchmarks"))
    import zoo_lib

    return zoo_lib.with_size(ZOO / "hf_mixtral.py", "tiny", Path(tmp))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return _mixtral(str(tmp_path_factory.mktemp("mixtral")))


def _plan(model: Path, **parallel) -> object:
    n = parallel.get("dp", 1) * parallel.get("tp", 1)
    return plan_from_dict({
        "version": 1, "model": {"file": str(model), "num_blocks": 4},
        "cluster": {"profile": "a100-80g", "num_gpus": n, "gpus_per_node": 8},
        "training": {"global_batch_size": 16, "micro_batch_size": 2, "seq_len": 32, "dtype": "bf16",
                     "optimizer": "adam"},
        "parallel": {"dp": 1, "tp": 1, "pp": 1, **parallel},
    })


def test_sp_is_offered_where_the_experts_run_whole_on_the_shard(mixtral: Path) -> None:
    assert model_spec(load_model_file(mixtral)).support_reason("sp") is None  # HF's stacked experts
    # a plan that shards the experts over tp cannot route a shard to them
    why = model_spec(load_model_file(ZOO / "torch_moe.py")).support_reason("sp")
    assert why is not None and why.startswith("the tp plan shards the experts (moe.experts)")


def test_ep_comes_from_the_tp_ranks_under_sp(mixtral: Path) -> None:
    plan = _plan(mixtral, tp=2, sequence_parallel=True, ep=2)  # dp 1: ep over the two tp ranks
    assert plan.parallel.layout.group("ep", 0) == (0, 1)
    with pytest.raises(PlanError, match="parallel.ep = 2 does not divide dp x cp = 1"):
        _plan(mixtral, tp=2, sequence_parallel=False, ep=2)

    from autopar.search.space import SearchSpace, enumerate_branches

    g = build_graph(str(mixtral))
    space = SearchSpace(num_gpus=2, gpus_per_node=8, global_batch=16, seq_len=32, micro_batches=(2,))
    found = {(b.dp, b.tp, b.sequence_parallel, b.ep) for b in enumerate_branches(g, space, Counter())}
    assert (1, 2, True, 2) in found and (1, 2, False, 2) not in found


def test_the_shard_is_priced(mixtral: Path) -> None:
    """Under SP a rank's experts run on its 1/tp of the tokens (their GEMMs, priced at the gathered
    sequence the TP region's GEMMs see, are re-priced on the shard) and a rank routes 1/tp of the
    tokens to the ep group."""
    g, cl = build_graph(str(mixtral)), load_cluster("a100-80g")
    off = estimate_plan(_plan(mixtral, tp=2, sequence_parallel=False), g, cl)
    on = estimate_plan(_plan(mixtral, tp=2, sequence_parallel=True), g, cl)
    assert on.time_breakdown_s["compute"] < off.time_breakdown_s["compute"]
    folded = estimate_plan(_plan(mixtral, tp=2, dp=2, sequence_parallel=True, ep=2), g, cl)
    plain = estimate_plan(_plan(mixtral, tp=2, dp=2, sequence_parallel=False, ep=2), g, cl)
    assert folded.moe["a2a_bytes_per_step"] == pytest.approx(plain.moe["a2a_bytes_per_step"] / 2)
    assert folded.moe["a2a_link"] == "nvlink"
    # the experts' states: E / ep experts a rank, their edp group dp x tp / ep = 2 ranks (ZeRO shards over it)
    assert _plan(mixtral, tp=2, dp=2, sequence_parallel=True, ep=2, zero=1).parallel.layout.size("edp") == 2
