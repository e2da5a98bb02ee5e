"""What the step's memory peak holds at once (cost.stage ``StageTerms.rank_other_bytes`` and
``mix_working_bytes``), as rehearsals of the real executor measured it:

* FSDP2 holds the previous block's reduce-scatter input (fp32) while the next block's backward runs
  -- where gradients are reduce-scattered inside backward (ZeRO-3; ZeRO-1/2 without a pipeline),
  for the executor's software, not Megatron's (its own gradient buffer);
* the micro-batch in backward has released its head's and loss's saved tensors before its blocks'
  backward, and, under a per-stage recompute mix, the activations of its later-mode blocks before an
  earlier-mode block re-runs.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from autopar.cluster import load_cluster
from autopar.cost.estimate import estimate_plan
from autopar.cost.stage import Config, build_terms
from autopar.cost.zero import held_reduce_input_bytes_per_param
from autopar.models.gpt import GPTConfig
from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training
from autopar.reference import gpt_graph, gpt_model_path

CFG = GPTConfig(num_layers=8, hidden_size=2048, num_heads=16, seq_len=2048, vocab_size=8192)


@functools.lru_cache(maxsize=None)
def _graph():
    return gpt_graph(CFG)


def _plan(**par) -> Plan:
    dp = par.get("dp", 1)
    n = dp * par.get("pp", 1) * par.get("tp", 1)
    return Plan(model=ModelRef(file=str(gpt_model_path(CFG)), num_blocks=CFG.num_layers),
                cluster=ClusterRef(profile="h100-80g", num_gpus=n, gpus_per_node=8),
                training=Training(global_batch_size=dp * 8, micro_batch_size=1, seq_len=CFG.seq_len, dtype="bf16"),
                parallel=Parallel(**par))


def _config(plan: Plan) -> Config:
    from autopar.cost.estimate import config_from_plan

    return config_from_plan(plan)


@pytest.mark.parametrize("par,held", [
    ({"dp": 8, "zero": 3}, 4.0),
    ({"dp": 4, "pp": 2, "zero": 3, "pp_schedule": "1f1b"}, 4.0),  # ZeRO-3 reduces per micro-batch at any pp
    ({"dp": 8, "zero": 1}, 4.0),  # its last micro-batch reduce-scatters block by block
    ({"dp": 8, "zero": 2}, 4.0),
    ({"dp": 4, "pp": 2, "zero": 1, "pp_schedule": "1f1b"}, 0.0),  # after the last backward
    ({"dp": 8, "zero": 0}, 0.0),  # DDP
])
def test_held_reduce_input_where_fsdp2_reduces_inside_backward(par: dict, held: float) -> None:
    cfg = _config(_plan(**par))
    assert held_reduce_input_bytes_per_param(cfg, load_cluster("h100-80g")) == held
    assert held_reduce_input_bytes_per_param(cfg, load_cluster("h100-80g-megatron")) == 0.0


def test_the_held_input_meets_a_released_block() -> None:
    """ZeRO-3 without recompute: the held fp32 input (4 B per block parameter) sits beside what the
    block before it released, so only its excess over one block's activations is in the peak."""
    cluster = load_cluster("h100-80g")
    t = build_terms(_graph(), cluster, _config(_plan(dp=8, zero=3, recompute="none")))
    assert t.held_reduce_bytes == pytest.approx(4 * t.block.params)
    without = dataclasses.replace(t, held_reduce_bytes=0.0)
    extra = t.rank_other_bytes(0, 0) - without.rank_other_bytes(0, 0)
    assert extra == pytest.approx(max(0.0, t.held_reduce_bytes - t.block.act_bytes))


def test_the_block_phase_no_longer_holds_the_micro_batchs_loss() -> None:
    cluster = load_cluster("h100-80g")
    t = build_terms(_graph(), cluster, _config(_plan(dp=8, zero=1, recompute="full")))
    block_phase = t.transient_bytes + t.block.peak_bytes + max(0.0, t.held_reduce_bytes - t.block.act_bytes)
    loss_phase = t.post.peak_bytes + t.zero3_gather_bytes
    assert t.rank_other_bytes(0, 0) == pytest.approx(max(block_phase - t.post.act_bytes, loss_phase))


def test_a_mix_releases_its_later_blocks_before_an_earlier_block_re_runs() -> None:
    """6 full + 2 none blocks: while the last full block re-runs, the two none blocks of its
    micro-batch are released, so the mix pays full's working set less their activations."""
    cluster = load_cluster("h100-80g")
    plan = _plan(dp=8, zero=3, recompute="full", recompute_blocks=((2, 0, 6),))
    t = build_terms(_graph(), cluster, _config(plan))
    none_act = t.recompute_parts["none"].act_bytes
    work_full = t.mode_working_bytes(0, 0, "full")
    assert work_full > 0
    got = t.mix_working_bytes(0, 0, {"none": 2, "selective": 0, "full": 6})
    assert got == pytest.approx(max(0.0, work_full - 2 * none_act))
    assert t.mix_working_bytes(0, 0, {"none": 0, "selective": 0, "full": 8}) == pytest.approx(work_full)
    est = estimate_plan(plan, _graph(), cluster)
    pure = estimate_plan(_plan(dp=8, zero=3, recompute="full", recompute_blocks=((0, 0, 8),)), _graph(), cluster)
    # the two none blocks cost their activations, not their activations on top of full's working set
    added = est.memory_bytes["activations"] - pure.memory_bytes["activations"]
    assert est.peak_memory_bytes - pure.peak_memory_bytes <= added - min(work_full, 2 * none_act) + 1
