"""Gradients travel in the dtype the software reduces them in (GPU readiness, M1): autopar run reduces
in fp32 at any training dtype (FSDP2's reduce_dtype, DDP over fp32 parameters under autocast,
ZeRO-1's fp32 accumulators), so its profiles price 4 bytes per gradient element where the training
dtype's 2 made bf16 gradient traffic half of what runs; a Megatron profile reduces its gradient
buffer in place (main_grad_bytes); parameters are all-gathered in the training dtype."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster import cluster_from_dict, load_cluster
from autopar.cost.comm import group_link
from autopar.cost.framework import grad_reduce_bytes
from autopar.cost.stage import Config
from autopar.cost.zero import per_microbatch_exposed, per_step_sync
from autopar.errors import ClusterError


def cfg(**changes) -> Config:
    fields = dict(dp=8, tp=1, pp=1, cp=1, cp_kind="ring", sequence_parallel=False, zero=1, recompute="none",
                  schedule="1f1b", virtual_stages=1, micro_batch=1, global_batch=64, seq_len=2048, dtype_bytes=2,
                  optimizer="adam")
    fields.update(changes)
    return Config(**fields)


def test_which_dtype_each_software_reduces_in() -> None:
    assert grad_reduce_bytes(cfg(), load_cluster("h100-80g")) == 4  # autopar run: fp32
    assert grad_reduce_bytes(cfg(), load_cluster("h200-141g")) == 4  # inherits h100-80g's software
    assert grad_reduce_bytes(cfg(), load_cluster("h100-80g-megatron")) == 2  # NeMo: its bf16 gradient buffer
    assert grad_reduce_bytes(cfg(), load_cluster("a100-80g")) == 4  # autopar run on A100s, as h100-80g
    assert grad_reduce_bytes(cfg(), load_cluster("a100-80g-megatron")) == 2  # Megatron-LM SC21: the training dtype
    assert grad_reduce_bytes(cfg(dtype_bytes=4), load_cluster("a100-80g-megatron")) == 4


@pytest.mark.parametrize("zero", [0, 1])
def test_once_per_step_sync_prices_fp32_gradients(zero: int) -> None:
    h100 = load_cluster("h100-80g")
    as_dtype = dataclasses.replace(h100, grad_reduce_bytes=0.0)
    link = group_link(h100, 8, 1)
    c = cfg(zero=zero)
    fp32, bf16 = per_step_sync(c, link, h100), per_step_sync(c, link, as_dtype)
    if zero == 0:  # the all-reduce of gradients: twice the bytes, about twice the time per parameter
        assert fp32[0] == pytest.approx(2 * bf16[0], rel=0.02)
        assert per_step_sync(cfg(zero=0, dtype_bytes=4), link, h100)[0] == pytest.approx(fp32[0])  # as fp32 training
    else:  # ZeRO-1: the reduce-scatter doubles, the parameter all-gather (bf16) does not
        c_rs = dataclasses.replace(h100, overlap_param_gather=False)
        rs32, gather32 = per_step_sync(c, link, c_rs)[:2]
        rs16, gather16 = per_step_sync(c, link, dataclasses.replace(c_rs, grad_reduce_bytes=0.0))[:2]
        assert rs32 == pytest.approx(2 * rs16, rel=0.02) and gather32 == gather16


def test_zero3_reduce_scatter_per_microbatch_in_fp32() -> None:
    h100 = dataclasses.replace(load_cluster("h100-80g"), overlap_cost_fraction=0.0)
    link = group_link(h100, 64, 1)  # across nodes: the collectives are slow enough to stick out
    c = cfg(zero=3, dp=64)
    params = 1e9
    got = per_microbatch_exposed(c, params, 0.0, 0.0, link, h100)  # nothing to hide behind
    as_dtype = per_microbatch_exposed(c, params, 0.0, 0.0, link, dataclasses.replace(h100, grad_reduce_bytes=0.0))
    # two bf16 all-gathers and one reduce-scatter: the reduce-scatter's doubling adds about a third
    assert got == pytest.approx(as_dtype * 4 / 3, rel=0.03)


def test_profile_setting_is_checked() -> None:
    import yaml

    from autopar.cluster import SHIPPED_PROFILES

    base = yaml.safe_load((SHIPPED_PROFILES / "a100-80g.yaml").read_text())
    base["software"] = {**base.get("software", {}), "grad_reduce_bytes": 2}
    assert cluster_from_dict(base, "x").grad_reduce_bytes == 2
    base["software"]["grad_reduce_bytes"] = 3
    with pytest.raises(ClusterError, match="'grad_reduce_bytes' must be 0 .*, 2 .* or 4"):
        cluster_from_dict(base, "x")
