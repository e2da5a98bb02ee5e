"""Per-op selective recompute (``parallel.recompute: op``): the executor's policy, the memory the cost
model prices for it against what the executor keeps, and where it is refused.

The oracle for memory is torch's memory tracker on the real model: after the forward of a tiny
Llama, the activations held under ``op`` exceed those held under ``full`` (which keeps only each
block's input) by exactly what the policy keeps, and the cost model's ``op_saved_bytes`` per block,
from the traced ops, must say the same.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from autopar.cluster import load_cluster
from autopar.cost.compute import region_time
from autopar.cost.estimate import estimate_plan
from autopar.cost.stage import Config, build_terms
from autopar.errors import PlanError
from autopar.executor.parallel.recompute import apply_recompute
from autopar.executor.runtime.introspect import inspect_model
from autopar.graph.cache import cached_graph
from autopar.graph.scaling import Shape
from autopar.modelfile import call_model, load_model_file
from autopar.plan import plan_from_dict
from autopar.recompute_ops import saves_gemm

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"
LLAMA = ZOO / "autopar_llama.py"
MICRO_BATCH = 2


def test_every_other_gemm_is_kept_counting_from_the_first():
    assert [saves_gemm(k) for k in range(1, 8)] == [True, False, True, False, True, False, True]


def _held_after_forward(mode: str) -> tuple[float, torch.Tensor]:
    """(activation bytes the tracker sees after the forward, the parameters' gradients after backward)."""
    mf = load_model_file(LLAMA)
    spec = inspect_model(mf, mf.build("meta"))
    torch.manual_seed(0)
    model = mf.build("cpu")
    inputs = mf.example_inputs(MICRO_BATCH, "cpu")
    apply_recompute(model, spec, mode)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = mf.loss_fn(call_model(model, inputs), inputs)
        snap = tracker.get_tracker_snapshot("current")
        loss.backward()
    act = sum(v for dev in snap.values() for k, v in dev.items() if str(k).endswith("ACT"))
    return float(act), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def held():
    return {mode: _held_after_forward(mode) for mode in ("none", "full", "op")}


def test_op_recompute_gives_the_same_gradients(held):
    assert torch.equal(held["op"][1], held["none"][1])


def test_op_keeps_between_full_and_none(held):
    assert held["full"][0] < held["op"][0] < held["none"][0]


def test_cost_model_prices_what_the_policy_keeps(held):
    graph, _ = cached_graph(str(LLAMA), seq_len=None, dtype="fp32")
    rt = region_time(graph.regions["block"], load_cluster("cpu-local-2"),
                     Shape(b=MICRO_BATCH, s_ratio=1.0, kv_ratio=1.0, t=1.0), seq_len=graph.seq_len)
    kept = held["op"][0] - held["full"][0]  # what op holds beyond each block's input
    predicted = graph.num_blocks * rt.op_saved_bytes
    assert predicted == pytest.approx(kept, rel=0.02)
    assert 0 < rt.op_saved_bytes < rt.saved_bytes


def _cfg(recompute: str) -> Config:
    return Config(dp=1, tp=1, pp=1, cp=1, cp_kind="ring", sequence_parallel=False, zero=0, recompute=recompute,
                  schedule="1f1b", virtual_stages=1, micro_batch=MICRO_BATCH, global_batch=8, seq_len=32,
                  dtype_bytes=4, optimizer="adam")


def test_op_is_priced_between_full_and_none_in_memory_and_time():
    graph, _ = cached_graph(str(LLAMA), seq_len=None, dtype="fp32")
    cluster = load_cluster("h100-80g")
    parts = {m: build_terms(graph, cluster, _cfg(m)).block for m in ("none", "full", "op")}
    assert parts["full"].act_bytes < parts["op"].act_bytes < parts["none"].act_bytes
    assert 0 < parts["op"].recompute_s < parts["full"].recompute_s


def _plan(recompute: str, model: Path = LLAMA, blocks: int = 4, profile: str = "h100-80g") -> object:
    return plan_from_dict({
        "version": 1, "model": {"file": str(model), "num_blocks": blocks},
        "cluster": {"profile": profile, "num_gpus": 1, "gpus_per_node": 1},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "dtype": "fp32",
                     "optimizer": "adam"},
        "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "cp_kind": "ring", "sequence_parallel": False, "zero": 0,
                     "recompute": recompute, "pp_schedule": "1f1b", "pp_virtual_stages": 1},
    })


def test_plan_takes_op_and_megatron_profiles_refuse_it():
    graph, _ = cached_graph(str(LLAMA), seq_len=None, dtype="fp32")
    assert estimate_plan(_plan("op"), graph, load_cluster("h100-80g")).peak_memory_bytes > 0
    megatron = load_cluster("h100-80g-megatron")
    with pytest.raises(PlanError, match="recompute op is not possible on h100-80g-megatron"):
        estimate_plan(_plan("op", profile="h100-80g-megatron"), graph, megatron)


def test_a_mixture_of_experts_refuses_op_with_its_reason():
    graph, _ = cached_graph(str(ZOO / "torch_moe.py"), seq_len=None, dtype="fp32")
    assert "mixture of experts" in graph.supports("op")
    with pytest.raises(PlanError, match="parallel.recompute op is not possible: the blocks hold a mixture"):
        estimate_plan(_plan("op", model=ZOO / "torch_moe.py", blocks=graph.num_blocks), graph, load_cluster("h100-80g"))


def test_the_search_offers_op_and_drops_it_on_megatron():
    from autopar.search.search import search
    from autopar.search.space import SearchSpace

    graph, _ = cached_graph(str(LLAMA), seq_len=None, dtype="fp32")
    space = SearchSpace(num_gpus=2, gpus_per_node=2, global_batch=8, seq_len=32, micro_batches=(2,), dtype_bytes=4,
                        recompute_modes=("op",))
    got = search(graph, load_cluster("h100-80g"), space, top_k=1)
    assert got.top and got.top[0].config.recompute == "op"
    megatron = load_cluster("h100-80g-megatron")
    with pytest.raises(PlanError, match="recompute op is not possible"):
        search(graph, megatron, space, top_k=1)
    both = dataclasses.replace(space, recompute_modes=("none", "op"))
    got = search(graph, megatron, both, top_k=1)
    assert any("recompute op" in reason for reason in got.rejected)
    assert got.top[0].config.recompute == "none"
