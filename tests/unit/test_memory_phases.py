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
    without = dataclasses.replace(t, held_reduce_bytes_per_param=0.0)
    extra = t.rank_other_bytes(0, 0) - without.rank_other_bytes(0, 0)
    assert extra == pytest.approx(max(0.0, t.held_reduce_bytes - t.block.act_bytes))


def test_the_block_phase_no_longer_holds_the_micro_batchs_loss() -> None:
    cluster = load_cluster("h100-80g")
    t = build_terms(_graph(), cluster, _config(_plan(dp=8, zero=1, recompute="full")))
    # FSDP2's root unit (the tied head) holds its gradients through the blocks' and the embedding's backward
    block_phase = (t.transient_bytes + t.block.peak_bytes + max(0.0, t.held_reduce_bytes - t.block.act_bytes)
                   + t.root_grad_bytes)
    loss_phase = t.post.peak_bytes + t.zero3_gather_bytes
    embedding_phase = t.pre.peak_bytes + t.root_grad_bytes
    assert t.root_grad_bytes > 0
    # beside the phases: the rank's rows of the step's batch (token ids)
    assert t.batch_bytes > 0
    assert t.rank_other_bytes(0, 0) == pytest.approx(max(block_phase - t.post.act_bytes, loss_phase, embedding_phase)
                                                     + t.batch_bytes)


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


BIG_VOCAB = GPTConfig(num_layers=4, hidden_size=512, num_heads=8, seq_len=2048, vocab_size=65536)


def _one_microbatch_plan(cfg: GPTConfig = CFG, **par) -> Plan:
    dp = par.get("dp", 1)
    n = dp * par.get("pp", 1) * par.get("tp", 1)
    return Plan(model=ModelRef(file=str(gpt_model_path(cfg)), num_blocks=cfg.num_layers),
                cluster=ClusterRef(profile="h100-80g", num_gpus=n, gpus_per_node=8),
                training=Training(global_batch_size=dp, micro_batch_size=1, seq_len=cfg.seq_len, dtype="bf16"),
                parallel=Parallel(**par))


@pytest.mark.parametrize("par,share", [
    ({"dp": 8, "zero": 3}, 1.0),  # FSDP2 makes its sharded gradients in backward
    ({"dp": 8, "zero": 1}, 1.0),
    ({"dp": 1}, 1.0),  # a lone rank: autograd's own
    ({"dp": 8, "zero": 0}, 0.5),  # DDP: its buckets persist, the gradients beside them do not
])
def test_a_steps_only_micro_batch_meets_its_loss_without_gradients(par: dict, share: float) -> None:
    def loss_free(cfg: Config, cluster) -> float:  # noqa: ANN001
        return build_terms(_graph(), cluster, cfg).loss_free_grads

    cfg = _config(_one_microbatch_plan(**par))
    assert cfg.num_microbatches == 1
    assert loss_free(cfg, load_cluster("h100-80g")) == share
    assert loss_free(cfg, load_cluster("h100-80g-megatron")) == 0.0  # its gradient buffer persists
    assert loss_free(_config(_plan(**par)), load_cluster("h100-80g")) == 0.0  # 8 micro-batches


def test_gpipe_meets_its_first_backward_without_gradients() -> None:
    """GPipe runs every forward of a step before its first backward: its activations peak before any
    gradient exists; 1F1B's later micro-batches meet the gradients of the earlier ones. The terms
    read it from their config, so terms evolved from 1F1B's (the search's) price GPipe's."""
    from autopar.cost.evolve import evolve

    h100 = load_cluster("h100-80g")
    one = build_terms(_graph(), h100, _config(_plan(dp=2, pp=2, zero=1, pp_schedule="1f1b")))
    assert one.loss_free_grads == 0.0
    gpipe = evolve(one, config=dataclasses.replace(one.config, schedule="gpipe"))
    assert gpipe.loss_free_grads == 1.0


@pytest.mark.parametrize("model,loss_peaks", [(BIG_VOCAB, True), (CFG, False)], ids=["vocab-64k", "vocab-8k"])
def test_the_peak_is_the_larger_of_the_loss_without_gradients_and_the_rest_with_them(model, loss_peaks) -> None:
    cluster = load_cluster("h100-80g")
    graph = gpt_graph(model)
    plan = _one_microbatch_plan(model, dp=8, zero=3, recompute="full")
    t = build_terms(graph, cluster, _config(plan))
    est = estimate_plan(plan, graph, cluster)
    params = model.num_layers * t.block.params + t.pre.params + t.post.params
    grads = params * t.state_split["grads"]
    states = params * t.state_bytes_per_param
    act = est.memory_bytes["activations"]
    # FSDP2 prefetches the first block to run backward once the output's gradient is made: beside
    # the head's backward, not the loss's (a loss_fn outside the model)
    loss_phase = max(t.post.peak_bytes, t.post.head_peak_bytes + t.zero3_gather_bytes)
    assert t.post.head_peak_bytes < t.post.peak_bytes and t.zero3_gather_bytes > 0
    at_loss = t.zero3_root_params_per_byte * (t.pre.params + t.post.params) + loss_phase + t.batch_bytes
    rest = t.rank_other_bytes(0, 0, loss=False)
    assert (at_loss - grads > rest) == loss_peaks
    # every activation (the step's one micro-batch) at the loss; at the end of its backward the first
    # block's and the embedding's, with every gradient but theirs, or, that block done, its gradients
    every = t.rank_activation_bytes(0, [model.num_layers * t.block.act_bytes + t.pre.act_bytes])
    every += t.loss_inflight() * t.post.act_bytes
    end = t.block.act_bytes + t.pre.act_bytes
    block_grads, pre_grads = t.block.params * t.state_split["grads"], t.pre.params * t.state_split["grads"]
    want = max(states - grads + every + max(at_loss, rest), states - block_grads - pre_grads + end + rest,
               states - pre_grads + end - t.block.act_bytes + rest) + t.reserve_bytes
    assert est.peak_memory_bytes == pytest.approx(want)
    assert est.memory_bytes["grads"] == (0.0 if loss_peaks else pytest.approx(grads - pre_grads))
    assert act in (every, end, end - t.block.act_bytes)
    # with a second micro-batch its loss meets the first one's gradients
    two = estimate_plan(dataclasses.replace(plan, training=dataclasses.replace(plan.training, global_batch_size=16)),
                        graph, cluster)
    assert two.memory_bytes["grads"] == pytest.approx(grads)
    # (twice the rows of the step's batch: t's terms price 8 samples)
    assert two.peak_memory_bytes == pytest.approx(states + two.memory_bytes["activations"] + max(at_loss, rest)
                                                  + t.batch_bytes + t.reserve_bytes)
