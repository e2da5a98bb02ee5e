"""(GPU readiness, B13) ring / all-gather attention as it would run on CUDA, checked on the CPU.

CUDA's flash kernel (FlashAttention-2) takes fp16 and bf16 only, where the CPU's, which every other
test runs, takes fp32 too: an fp32 piece now runs on explicit scores (attention_math.py); a query
under autocast is cast to autocast's dtype as ``scaled_dot_product_attention`` would be (autocast
has no rule for the flash backward op, which got the function's fp32 tensors); the kernel's
log-sum-exp is a dense copy of the chunk's slice. The CUDA branch is taken on CPU tensors through
``ring_attention._device_type``, with the CUDA ops replaced by stand-ins that refuse what
FlashAttention-2 refuses and otherwise run the CPU kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.executor.parallel import context_parallel as cpmod
from autopar.executor.parallel import ring_attention as ra


def _reference(q, k, v, causal: bool, scale: float):  # noqa: ANN001, ANN202
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return q, k, v, out


@pytest.mark.parametrize("dq,dv,heads,kv_heads", [(16, 16, 4, 4), (24, 16, 4, 4), (16, 16, 4, 2), (24, 8, 4, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_math_piece_matches_sdpa(monkeypatch, dq: int, dv: int, heads: int, kv_heads: int, causal: bool) -> None:
    """The explicit-scores piece keeps the flash pair's contract: (out, lse), and the backward
    given the output -- MLA's narrower value head and grouped-query K/V included."""
    monkeypatch.setattr(ra, "flash_takes", lambda *_: False)
    torch.manual_seed(0)
    q0 = torch.randn(2, heads, 10, dq, dtype=torch.float64)
    k0 = torch.randn(2, kv_heads, 10, dq, dtype=torch.float64)
    v0 = torch.randn(2, kv_heads, 10, dv, dtype=torch.float64)
    scale = dq ** -0.5
    q, k, v, ref = _reference(q0, k0, v0, causal, scale)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    with torch.no_grad():
        out, lse = ra._flash(q0, k0, v0, causal, scale)
        torch.testing.assert_close(out, ref.detach())
        torch.testing.assert_close(lse, torch.logsumexp(_scores(q0, k0, causal, scale), -1))
        gq, gk, gv = ra._flash_backward(dout, q0, k0, v0, out, lse, causal, scale)
    torch.testing.assert_close(gq, q.grad)
    torch.testing.assert_close(gk, k.grad)
    torch.testing.assert_close(gv, v.grad)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


def test_flash_takes_what_flash_attention_2_takes() -> None:
    assert not ra.flash_takes("cuda", torch.float32, 64)
    assert ra.flash_takes("cuda", torch.bfloat16, 128) and ra.flash_takes("cuda", torch.float16, 256)
    assert not ra.flash_takes("cuda", torch.bfloat16, 288)
    assert ra.flash_takes("cpu", torch.float32, 512)


@pytest.fixture
def cuda_flash(monkeypatch) -> list[str]:
    """The CUDA branch on CPU tensors: the CUDA flash ops replaced by stand-ins that raise on what
    FlashAttention-2 rejects (a dtype other than fp16 / bf16; a strided log-sum-exp, which it would
    read as dense) and run the CPU kernels otherwise. Returns the calls made."""
    calls: list[str] = []
    aten = torch.ops.aten
    cpu_fwd, cpu_bwd = aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward

    def check(*tensors: torch.Tensor) -> None:
        if any(t.dtype not in (torch.float16, torch.bfloat16) for t in tensors):
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")

    def fwd(q, k, v, dropout, causal, debug=False, *, scale=None):  # noqa: ANN001, ANN202
        check(q, k, v)
        calls.append("forward")
        out, lse = cpu_fwd(q, k, v, dropout, causal, scale=scale)
        return (out, lse, None, None, q.shape[-2], k.shape[-2], None, None, None)

    def bwd(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout, causal, seed, offset, *, scale=None):  # noqa: ANN001, ANN202
        check(dout, q, k, v, out)
        if not lse.is_contiguous():
            raise RuntimeError("a strided log-sum-exp: the kernel would read other rows'")
        calls.append("backward")
        return cpu_bwd(dout, q, k, v, out, lse, dropout, causal, scale=scale)

    monkeypatch.setattr(ra, "_device_type", lambda t: "cuda")
    monkeypatch.setattr(aten, "_scaled_dot_product_flash_attention", fwd)
    monkeypatch.setattr(aten, "_scaled_dot_product_flash_attention_backward", bwd)
    return calls


def test_fp32_pieces_on_cuda_do_not_reach_flash_attention(cuda_flash: list[str]) -> None:
    """An fp32 plan's ring pieces on a GPU: FlashAttention-2 raised; explicit scores now."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    out, lse = ra._flash(q, k, v, True, 0.25)
    ra._flash_backward(torch.randn_like(out), q, k, v, out, lse, True, 0.25)
    assert cuda_flash == []


def test_a_chunks_log_sum_exp_reaches_the_kernel_dense(cuda_flash: list[str]) -> None:
    """The backward of one query chunk of a two-chunk shard: its log-sum-exp is a strided slice of
    the shard's, given to the CUDA kernel as a dense copy; the gradients are the CPU kernel's."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16, dtype=torch.bfloat16) for _ in range(3))
    out, lse = ra._flash(q, k, v, True, 0.25)
    first = slice(0, 8)
    assert not lse[:, :, first].is_contiguous()
    dout = torch.randn_like(out)
    got = ra._flash_backward(dout[:, :, first], q[:, :, first], k[:, :, first], v[:, :, first], out[:, :, first],
                             lse[:, :, first], True, 0.25)
    assert cuda_flash == ["forward", "backward"]
    want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout[:, :, first], q[:, :, first], k[:, :, first], v[:, :, first], out[:, :, first],
        lse[:, :, first].contiguous(), 0.0, True, scale=0.25)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


class _Recorder:
    dtypes: list[torch.dtype] = []

    @classmethod
    def apply(cls, q, k, v, *rest):  # noqa: ANN001, ANN206
        cls.dtypes = [q.dtype, k.dtype, v.dtype]
        return q


@pytest.mark.parametrize("kind", ["ring", "allgather"])
def test_ring_operands_follow_autocast(monkeypatch, kind: str) -> None:
    """Under autocast the ring / all-gather function gets the autocast dtype, as SDPA would: an fp32
    query (rotary tables in fp32) reached the flash backward in fp32, which CUDA's kernel refuses."""
    monkeypatch.setattr(cpmod, "RingAttention", _Recorder)
    monkeypatch.setattr(cpmod, "AllGatherAttention", _Recorder)
    attn = cpmod.ContextParallelAttention(kind, None, 2, 0, 8)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8, dtype=torch.bfloat16), torch.randn(1, 2, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn(q, k, v)
    assert _Recorder.dtypes == [torch.bfloat16] * 3
    attn(q, k.float(), v)  # no autocast: the query's dtype, as before
    assert _Recorder.dtypes == [torch.float32] * 3


def test_ulysses_orders_move_to_the_device_once() -> None:
    """(M13) Ulysses' sequence order is on the device once per module, not copied from the host in
    every block's forward (a host-to-GPU copy of a pageable tensor drains the stream)."""
    attn = cpmod.ContextParallelAttention("ulysses", None, 2, 0, 8)
    dev = torch.device("cpu")
    order, back = attn.orders(dev)
    assert attn.orders(dev)[0] is order and attn.orders(dev)[1] is back
    want = torch.argsort(torch.cat([cpmod.shard_indices(8, 2, r) for r in range(2)]))
    assert torch.equal(order, want) and torch.equal(back, torch.argsort(want))
    fake_order, _ = attn.orders(dev, fake=True)
    assert fake_order is not order and torch.equal(fake_order, order)


@pytest.mark.parametrize("causal", [False, True])
def test_math_piece_in_query_blocks_is_the_whole_piece(causal: bool) -> None:
    """The explicit scores are taken a block of query rows at a time (a 16k-token chunk's would be
    tens of GiB at once): blocks of 3 rows, and of 1, give the one-block result."""
    from autopar.executor.parallel import attention_math as am

    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 10, 8, dtype=torch.float64) for _ in range(4))
    whole_out, whole_lse = am.math_piece(q, k, v, causal, 0.3)
    whole_grads = am.math_piece_backward(dout, q, k, v, whole_out, whole_lse, causal, 0.3)
    for rows in (3, 1):
        budget = rows * 2 * 3 * 10 * 8 * am._LIVE  # (b, heads, keys) fp64 per row, _LIVE of them
        assert len(am.query_blocks(q, 10, budget)) == -(-10 // rows)
        out, lse = am.math_piece(q, k, v, causal, 0.3, budget)
        torch.testing.assert_close(out, whole_out)
        torch.testing.assert_close(lse, whole_lse)
        for g, w in zip(am.math_piece_backward(dout, q, k, v, out, lse, causal, 0.3, budget), whole_grads):
            torch.testing.assert_close(g, w)


def test_query_blocks_bound_a_long_chunk() -> None:
    from autopar.executor.parallel import attention_math as am

    q = torch.empty(1, 32, 16384, 128, device="meta")
    blocks = am.query_blocks(q, 16384)
    rows = blocks[0].stop - blocks[0].start
    assert 1 * 32 * rows * 16384 * 4 * am._LIVE <= am.BLOCK_BYTES and blocks[-1].stop == 16384


def test_ulysses_moves_autocast_dtype(monkeypatch) -> None:
    """(M16) Under autocast Ulysses' all-to-alls carry autocast's dtype: SDPA casts after them
    anyway, and an fp32 query (rotary tables in fp32) moved twice the bytes the price holds."""
    import torch.distributed._functional_collectives as fc

    moved: list[torch.dtype] = []
    monkeypatch.setattr(fc, "all_to_all_single_autograd", lambda x, out, inp, group: (moved.append(x.dtype), x)[1])
    attn = cpmod.ContextParallelAttention("ulysses", None, 2, 0, 8)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8, dtype=torch.bfloat16), torch.randn(1, 2, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(q, k, v)
    assert moved == [torch.bfloat16] * 4 and out.dtype == torch.bfloat16
