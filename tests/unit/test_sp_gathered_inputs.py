"""Sequence parallelism as DTensor runs it: a column-parallel Linear saves its input after the
all-gather, at the full sequence (what the executor and torchtitan keep for backward), where
Megatron-LM saves the sequence shard and gathers it again. The trace marks a block's saved GEMM
inputs; the cost model keeps the replicated ones whole under SP where the profile's software saves
them so (``sp_saves_gathered_input``: autopar run, torchtitan), and divides them where it does not
(Megatron-LM, the ``a100-80g-megatron`` profile of its SC21 runs)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cost.compute import region_time
from autopar.graph.scaling import Shape


def _gathered(fit):
    return [q for q in fit.saved if q.gemm_input and q.exps.replicated]


def test_a_block_saves_two_gathered_gemm_inputs(small_gpt) -> None:
    block = small_gpt.regions["block"]
    gathered = _gathered(block)
    # the attention's QKV input and the MLP's first Linear's input, each (b, s, h) in bf16
    assert len(gathered) == 2
    h, s = 1024, 1024
    assert all(q.nbytes == s * h * 2 for q in gathered)
    # the inputs of the row-parallel Linears are TP-sharded, not replicated
    assert any(q.gemm_input and q.exps.t > 0.5 for q in block.saved)


def test_executor_sp_keeps_the_gathered_inputs_whole(small_gpt, a100, a100_megatron) -> None:
    from autopar.cluster import load_cluster

    block = small_gpt.regions["block"]
    tp = 4
    shape = Shape(b=1, s_ratio=1.0, kv_ratio=1.0, t=tp, sp=tp)
    executor = load_cluster("h100-80g")
    assert executor.sp_saves_gathered_input and a100.sp_saves_gathered_input  # both price autopar run
    assert not a100_megatron.sp_saves_gathered_input
    megatron = dataclasses.replace(executor, sp_saves_gathered_input=False)
    executor_saved = region_time(block, executor, shape).saved_bytes
    megatron_saved = region_time(block, megatron, shape).saved_bytes
    whole = sum(q.nbytes for q in _gathered(block))
    assert abs((executor_saved - megatron_saved) - whole * (1 - 1 / tp)) < 1.0
    # without SP the two agree: nothing is gathered
    plain = Shape(b=1, s_ratio=1.0, kv_ratio=1.0, t=tp, sp=1.0)
    assert region_time(block, executor, plain).saved_bytes == region_time(block, megatron, plain).saved_bytes


def test_autocast_kinds_keep_a_weight_copy_per_micro_batch(small_gpt, a100_megatron, make_config) -> None:
    """ZeRO-0 under autopar run trains under autocast over fp32 parameters: each Linear saves its
    weight's 16-bit copy per micro-batch, and the activations are autocast's (the fp32 residual
    stream: graph/cuda_autocast.py); FSDP2's param_dtype (ZeRO-3 here) and Megatron keep neither."""
    from autopar.cluster import load_cluster
    from autopar.cost.stage import build_terms

    executor = load_cluster("h100-80g")
    z0 = build_terms(small_gpt, executor, make_config(dp=8, zero=0)).block
    z3 = build_terms(small_gpt, executor, make_config(dp=8, zero=3)).block
    assert z0.act_bytes - z3.act_bytes == pytest.approx(z0.autocast_act_bytes)
    assert z0.autocast_act_bytes > z0.params * 2  # fp16 training: 2 bytes per weight, and fp32 activations
    assert z3.autocast_act_bytes == 0.0
    full = build_terms(small_gpt, executor, make_config(dp=8, zero=0, recompute="full")).block
    # full recompute keeps the block's input only: the residual stream, fp32 under autocast
    assert full.act_bytes == 2 * build_terms(small_gpt, executor, make_config(dp=8, zero=3, recompute="full")).block.act_bytes
    m0 = build_terms(small_gpt, a100_megatron, make_config(dp=8, zero=0)).block
    m3 = build_terms(small_gpt, a100_megatron, make_config(dp=8, zero=3)).block
    assert m0.act_bytes == m3.act_bytes
