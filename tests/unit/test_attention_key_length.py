"""A fused attention op is priced at the key length its trace recorded (graph/trace.py records
(batch x heads, query length, key length, head dim)), scaled with the plan's sequence only where the
fit says the keys grow with it: image patches and a fixed-length encoder output keep their length."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.cluster import load_cluster
from autopar.cost.compute import _key_length, op_time_s
from autopar.graph.scaling import Exps, FitOp, Shape
from autopar.graph.trace import _attention_dims, run_and_trace

H100 = load_cluster("h100-80g")


def _attn(dims, kv_exps: Exps) -> FitOp:
    none = Exps(b=0.0, s=0.0, t=0.0)
    return FitOp(phase="fwd", kind="attn", flops=1e9, flops_exps=Exps(b=1.0, s=0.0, t=1.0), bytes=0.0,
                 bytes_exps=none, dims=dims, dims_exps=(Exps(b=1.0, s=0.0, t=1.0), none, kv_exps, none))


def test_the_trace_records_the_key_length_of_each_layout():
    q, k = torch.empty(2, 16, 77, 64, device="meta"), torch.empty(2, 4, 257, 64, device="meta")
    assert _attention_dims("_scaled_dot_product_flash_attention", (q, k, k)) == (32, 77, 257, 64)
    grad = torch.empty_like(q)
    assert _attention_dims("_scaled_dot_product_efficient_attention_backward", (grad, q, k, k)) == (32, 77, 257, 64)
    bshd_q, bshd_k = q.transpose(1, 2), k.transpose(1, 2)  # _flash_attention_* keep (batch, seq, heads, dim)
    assert _attention_dims("_flash_attention_forward", (bshd_q, bshd_k, bshd_k)) == (32, 77, 257, 64)
    assert _attention_dims("_scaled_dot_product_flash_attention", (q,)) is None


def test_traced_sdpa_carries_its_shape():
    w = torch.nn.Parameter(torch.empty(16, 16, device="meta"))  # traced on meta, as graph/build.py does

    def step(set_region):
        set_region("block")
        q = (torch.empty(2, 50, 16, device="meta") @ w).view(2, 50, 4, 4).transpose(1, 2)
        kv = (torch.empty(2, 9, 16, device="meta") @ w).view(2, 9, 4, 4).transpose(1, 2)  # cross-attention to 9 keys
        out = F.scaled_dot_product_attention(q, kv, kv)
        set_region("bwd:block")
        out.sum().backward()

    ops = [o for o in run_and_trace(step, iter([w])).ops if o.kind == "attn"]
    assert {o.phase for o in ops} == {"fwd", "bwd"}
    assert all(o.dims == (8, 50, 9, 4) for o in ops), [o.dims for o in ops]


def test_patches_keep_their_length_and_a_sequence_scales():
    patches = _attn((16, 257, 257, 64), Exps(b=0.0, s=0.0, t=0.0))
    tokens = _attn((16, 4096, 4096, 128), Exps(b=0.0, s=1.0, t=0.0))
    cp2 = Shape(b=1.0, s_ratio=0.5, kv_ratio=2.0, t=1.0)  # twice the traced sequence over cp 2
    assert _key_length(patches, cp2, seq_len=1) == 257  # not the model's (absent) sequence
    assert _key_length(tokens, cp2, seq_len=4096) == 8192  # every query meets the whole sequence's keys
    legacy = FitOp(phase="fwd", kind="attn", flops=1e9, flops_exps=Exps(), bytes=0.0, bytes_exps=Exps(),
                   dims=None, dims_exps=None)
    assert _key_length(legacy, cp2, seq_len=4096) == 8192


def test_a_short_key_length_is_priced_slower_per_flop_than_a_long_one():
    one = Shape(b=1.0, s_ratio=1.0, kv_ratio=1.0, t=1.0)
    short = op_time_s(_attn((16, 257, 257, 64), Exps(b=0.0, s=0.0, t=0.0)), one, H100, seq_len=1)[0]
    long = op_time_s(_attn((16, 8192, 8192, 64), Exps(b=0.0, s=0.0, t=0.0)), one, H100, seq_len=1)[0]
    one_token = H100.attention_efficiency_at(1.0)
    assert long < short < 1e9 / (H100.peak_flops * one_token)  # never priced as one key per query
