"""Ring / all-gather attention's per-piece kernels (executor/ring_attention.py) against PyTorch's own
attention: forward output and log-sum-exp, and the backward given the output -- including a value head
narrower than the query's (multi-head latent attention) and grouped-query K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.executor import ring_attention as ra


@pytest.mark.parametrize("dq,dv,heads,kv_heads", [(16, 16, 4, 4), (24, 16, 4, 4), (16, 16, 4, 2), (24, 8, 4, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_piece_matches_sdpa(dq: int, dv: int, heads: int, kv_heads: int, causal: bool) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, heads, 10, dq, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, 10, dq, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, 10, dv, dtype=torch.float64, requires_grad=True)
    scale = dq ** -0.5
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=heads != kv_heads)
    dout = torch.randn_like(ref)
    ref.backward(dout)

    with torch.no_grad():
        out, lse = ra._flash(q, k, v, causal, scale)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref)
        gq, gk, gv = ra._flash_backward(dout, q, k, v, out, lse, causal, scale)
    torch.testing.assert_close(gq, q.grad)
    torch.testing.assert_close(gk, k.grad)
    torch.testing.assert_close(gv, v.grad)
