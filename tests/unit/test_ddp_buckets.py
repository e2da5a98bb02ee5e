"""DDP's gradient all-reduce as buckets (issue 18): where the sync does not overlap backward, each
bucket is one collective that pays its own latency and rendezvous, not just its share of bandwidth."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cost.comm import axis_link, collective_time_s
from autopar.cost.framework import grad_reduce_bytes
from autopar.cost.stage import build_terms
from autopar.cost.zero import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, ddp_bucket_sizes
from autopar.layout import Layout


def ddp_buckets(grad_bytes: float) -> list[float]:
    """Each bucket of ``ddp_bucket_sizes`` in order, in bytes: the per-bucket reference."""
    return [b for b, count in ddp_bucket_sizes(grad_bytes) for _ in range(count)]


def test_buckets_follow_ddp_default_caps() -> None:
    assert ddp_buckets(0) == []
    assert ddp_buckets(1000.0) == [1000.0]
    mib = 2**20
    assert ddp_buckets(7.5 * mib) == [DDP_FIRST_BUCKET_BYTES, 6.5 * mib]
    many = ddp_buckets(DDP_FIRST_BUCKET_BYTES + 2 * DDP_BUCKET_BYTES + 3.0)
    assert many == [DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES, DDP_BUCKET_BYTES, 3.0]
    assert sum(ddp_buckets(123.4 * mib)) == pytest.approx(123.4 * mib)
    # A 175 B model's gradients: hundreds of equal buckets, priced once per size (the search builds
    # terms for thousands of configurations; one collective per bucket made it 5x slower).
    assert ddp_bucket_sizes(DDP_FIRST_BUCKET_BYTES + 400 * DDP_BUCKET_BYTES + 5.0) == (
        (DDP_FIRST_BUCKET_BYTES, 1), (DDP_BUCKET_BYTES, 400), (5.0, 1))


@pytest.mark.parametrize("overlap", [False, True])
def test_an_exposed_ddp_sync_costs_each_bucket_as_one_collective(small_gpt, a100, make_config, overlap: bool) -> None:
    cluster = dataclasses.replace(a100, overlap_grad_reduce=overlap)
    cfg = make_config(dp=8, global_batch=8, seq_len=1024)  # zero 0, tp 1, pp 1: the executor runs DDP
    terms = build_terms(small_gpt, cluster, cfg)
    params = small_gpt.num_blocks * terms.block.params + terms.pre.params + terms.post.params
    if overlap:  # hidden buckets; the last one is the floor, as before
        assert terms.grad_sync_fixed_s == 0.0
        return
    link = axis_link(cluster, Layout.of(cfg), "dp_cp")
    buckets = ddp_buckets(params * grad_reduce_bytes(cfg, cluster))  # autopar run's DDP reduces fp32
    assert len(buckets) > 2
    exposed = sum(collective_time_s("all_reduce", b, link) for b in buckets)
    assert params * terms.grad_sync_s_per_param + terms.grad_sync_fixed_s == pytest.approx(exposed, rel=1e-9)
    assert terms.grad_sync_fixed_s > 0
    # FSDP2 replicate (tp > 1) and ZeRO-1 run no DDP buckets: nothing added there.
    assert build_terms(small_gpt, cluster, make_config(dp=4, tp=2, global_batch=8, seq_len=1024)).grad_sync_fixed_s == 0
    assert build_terms(small_gpt, cluster, make_config(dp=8, zero=1, global_batch=8, seq_len=1024)).grad_sync_fixed_s == 0


def test_the_step_tail_carries_the_bucket_latencies(small_gpt, a100, make_config) -> None:
    from autopar.cost.step import evaluate

    cfg = make_config(dp=8, global_batch=64, seq_len=1024)
    exposed, hidden = (build_terms(small_gpt, dataclasses.replace(a100, overlap_grad_reduce=o), cfg) for o in (False, True))
    rank = evaluate(exposed, [small_gpt.num_blocks], 1.0, 1.0, a100.peak_flops).ranks[0]
    assert rank.tail_s == pytest.approx(rank.params * (exposed.grad_sync_s_per_param + exposed.after_sync_s_per_param)
                                        + exposed.grad_sync_fixed_s, rel=1e-9)
    assert hidden.grad_sync_fixed_s == 0.0
