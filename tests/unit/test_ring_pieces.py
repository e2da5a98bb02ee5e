"""Ring / all-gather attention's per-piece kernels (executor/parallel/ring_attention.py) against PyTorch's own
attention: forward output and log-sum-exp, and the backward given the output -- including a value head
narrower than the query's (multi-head latent attention) and grouped-query K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.executor.parallel import ring_attention as ra


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


def test_send_recv_receives_into_a_dense_buffer(monkeypatch) -> None:
    """(GPU readiness, C6) a permuted tensor sent round the ring is received into a contiguous
    buffer: empty_like kept the permuted strides, and NCCL and gloo write a dense one."""
    import torch.distributed as dist

    from autopar.executor.parallel import ring_attention

    seen: list = []

    class _Op:
        def __init__(self, op, tensor, peer, group) -> None:  # noqa: ANN001
            seen.append((op, tensor))

    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [])
    monkeypatch.setattr(ring_attention, "_peer", lambda group, r: r)
    t = torch.randn(2, 3, 5, 4).permute(0, 2, 1, 3)  # (b, s, h, d) view of (b, h, s, d): not contiguous
    assert not t.is_contiguous()
    out = ring_attention.send_recv(t, 1, 1, None)
    assert out.is_contiguous() and out.shape == t.shape and out.dtype == t.dtype
    assert all(x.is_contiguous() for _, x in seen)
