"""Context-parallel attention on flash kernels: a cp rank's query shard against the sequence's K/V
blocks, merged by log-sum-exp, in memory linear in the local sequence (the ring and all-gather
kinds of executor/parallel/context_parallel.py).

Each rank holds chunks of the sequence (``shard_chunks``: chunks r and 2cp-1-r of 2cp equal chunks,
for causal balance; contiguous shards where the length does not split so). A query chunk against a
key chunk is *full* (every key precedes every query), *causal* (the same positions) or *empty*,
so every piece runs one flash-attention kernel -- ``_scaled_dot_product_flash_attention`` on CUDA,
``..._for_cpu`` on the CPU, both returning the log-sum-exp (on CUDA an fp32 piece, which
FlashAttention-2 cannot take, runs on explicit scores: attention_math.py) -- and the pieces merge exactly:

    lse = logaddexp(lse_a, lse_b),   out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)

Backward is flash attention's own, per piece, given the *merged* output and log-sum-exp: the kernel
recomputes each piece's softmax as exp(scores - lse) and takes rowsum(dout * out) from the merged
output, which is exactly each piece's share of the full attention's gradient. So autograd saves
only q, k, v, the output and the log-sum-exp (no s^2 scores: flash attention's memory), and
recomputes inside the kernels.

* ``RingAttention``: K/V travel around the ring by P2P (send to r+1, receive from r-1) between the
  pieces. Backward sends each block on again together with the fp32 gradient accumulated for it;
  after cp shifts each block's gradient is back at its owner.
* ``AllGatherAttention``: K/V all-gathered once (kept for backward: linear in the sequence), the
  gradients of every block reduce-scattered back to their owners.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.executor.parallel.attention_math import math_piece, math_piece_backward

Chunks = Sequence[tuple[int, int]]  # (first position, length) per contiguous chunk, in local order


def shard_chunks(seq_len: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The chunks of the sequence cp ``rank`` holds (context_parallel.shard_indices, as ranges)."""
    if seq_len % (2 * cp):
        n = seq_len // cp
        return [(rank * n, n)]
    c = seq_len // (2 * cp)
    return [(rank * c, c), ((2 * cp - 1 - rank) * c, c)]


def _kind(q: tuple[int, int], k: tuple[int, int]) -> str | None:
    """"full", "causal" or None (nothing to attend) for a query chunk against a key chunk."""
    (qs, ql), (ks, kl) = q, k
    if ks + kl <= qs:
        return "full"
    if ks >= qs + ql:
        return None
    if (ks, kl) == (qs, ql):
        return "causal"
    raise AssertionError(f"query chunk {q} and key chunk {k} overlap in part")


def _local(chunks: Chunks) -> list[tuple[int, int, slice]]:
    """(start, length, local slice) of each chunk."""
    out, off = [], 0
    for start, n in chunks:
        out.append((start, n, slice(off, off + n)))
        off += n
    return out


def _repeat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V repeated to q's heads (grouped-query attention) for one piece only: the ring and the
    all-gather carry the kv heads alone, and the flash kernels want equal heads."""
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _fold(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of repeated K/V summed back onto the kv heads (the inverse of ``_repeat``)."""
    b, h, s, d = g.shape
    return g if h == kv_heads else g.view(b, kv_heads, h // kv_heads, s, d).sum(2)


CUDA_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # FlashAttention-2's: no fp32 kernel
CUDA_FLASH_MAX_HEAD_DIM = 256


def _device_type(t: torch.Tensor) -> str:
    """The device type whose kernels a piece runs on (a seam: the CPU tests take the CUDA branch)."""
    return t.device.type


def flash_takes(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the device's flash kernel takes a piece of ``dtype`` and ``head_dim``: CUDA's
    (FlashAttention-2) fp16 and bf16 only, head dims up to 256 -- an fp32 piece raises there, where
    the CPU's kernel, which the tests run, takes any floating dtype. Elsewhere the piece runs on
    explicit scores (attention_math.py)."""
    if device_type != "cuda":
        return True
    return dtype in CUDA_FLASH_DTYPES and head_dim <= CUDA_FLASH_MAX_HEAD_DIM


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """(out, lse) of one piece: the flash kernel of the device, or explicit scores where it has
    none for the piece's dtype or head dim (``flash_takes``)."""
    k, v = _repeat(q, k, v)
    dv = v.shape[-1]
    v = _pad_head(v, q.shape[-1])
    device = _device_type(q)
    if not flash_takes(device, q.dtype, q.shape[-1]):
        out, lse = math_piece(q, k, v, causal, scale)
    elif device == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out[..., :dv], lse


def _pad_head(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` zero-padded on its head dim to ``dim``: flash kernels take one head dim for q, k and v, and a
    value head narrower than the query's (multi-head latent attention: 128 against 192) gives zero
    output columns on the padding, sliced off after."""
    return t if t.shape[-1] == dim else torch.nn.functional.pad(t, (0, dim - t.shape[-1]))


def _flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):  # noqa: ANN001, ANN202
    """(dq, dk, dv) of one piece given the merged ``out`` and ``lse`` (no dropout); dk, dv on k's heads."""
    kv_heads = k.shape[1]
    k, v = _repeat(q, k, v)
    dv = v.shape[-1]
    v, dout, out = (_pad_head(t, q.shape[-1]) for t in (v, dout, out))
    device = _device_type(q)
    if not flash_takes(device, q.dtype, q.shape[-1]):
        gq, gk, gv = math_piece_backward(dout, q, k, v, out, lse, causal, scale)
    elif device == "cuda":
        none = torch.empty(0, dtype=torch.int64, device=q.device)
        # lse is a chunk's slice of the shard's (b, heads, s) log-sum-exp: strided. q, k, v, out
        # and dout go to the kernel with their strides, but FlashAttention-2 takes its log-sum-exp
        # as a bare pointer to a dense (b, heads, s_q) block: a dense copy (a few KB)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), none, none, q.shape[-2], k.shape[-2], 0.0, causal, none, none,
            scale=scale)
    else:
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    return gq, _fold(gk, kv_heads), _fold(gv[..., :dv], kv_heads)


class _Merge:
    """The online softmax of a query shard over K/V blocks, per query chunk (fp32 output)."""

    def __init__(self, q: torch.Tensor, chunks: Chunks, scale: float) -> None:
        self.q, self.chunks, self.scale = q, _local(chunks), scale
        self.out: list[torch.Tensor | None] = [None] * len(self.chunks)
        self.lse: list[torch.Tensor | None] = [None] * len(self.chunks)

    def add(self, k: torch.Tensor, v: torch.Tensor, k_chunks: Chunks) -> None:
        for i, (qs, ql, qsl) in enumerate(self.chunks):
            for ks, kl, ksl in _local(k_chunks):
                kind = _kind((qs, ql), (ks, kl))
                if kind is None:
                    continue
                o, lse = _flash(self.q[:, :, qsl], k[:, :, ksl], v[:, :, ksl], kind == "causal", self.scale)
                o, prev = o.float(), self.lse[i]
                if prev is None:
                    self.out[i], self.lse[i] = o, lse
                    continue
                new = torch.logaddexp(prev, lse)
                self.out[i] = self.out[i] * torch.exp(prev - new)[..., None] + o * torch.exp(lse - new)[..., None]
                self.lse[i] = new

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in the query's dtype, lse): every query chunk attends at least to itself."""
        return (torch.cat([o.to(self.q.dtype) for o in self.out], dim=2),  # type: ignore[union-attr]
                torch.cat(self.lse, dim=2))  # type: ignore[arg-type]


def _block_backward(dout, q, out, lse, q_chunks: Chunks, k, v, k_chunks: Chunks, scale: float,  # noqa: ANN001
                    dq: torch.Tensor) -> torch.Tensor:
    """Adds this K/V block's share of dq into ``dq`` (fp32); returns the block's (dk, dv), stacked, fp32."""
    dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
    for qs, ql, qsl in _local(q_chunks):
        for ks, kl, ksl in _local(k_chunks):
            kind = _kind((qs, ql), (ks, kl))
            if kind is None:
                continue
            gq, gk, gv = _flash_backward(dout[:, :, qsl], q[:, :, qsl], k[:, :, ksl], v[:, :, ksl], out[:, :, qsl],
                                         lse[:, :, qsl], kind == "causal", scale)
            dq[:, :, qsl] += gq.float()
            dkv[0][:, :, ksl] += gk.float()
            dkv[1][:, :, ksl] += gv.float()
    return dkv


def _peer(group: dist.ProcessGroup, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def send_recv(t: torch.Tensor, to: int, frm: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``t`` to group rank ``to`` while receiving a tensor like it from ``frm``. The receive
    buffer is dense whatever ``t``'s strides (empty_like would keep a permuted layout; NCCL and gloo
    write a contiguous buffer)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    ops = [dist.P2POp(dist.isend, t.contiguous(), _peer(group, to), group),
           dist.P2POp(dist.irecv, out, _peer(group, frm), group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


def all_gather(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` = the group's ``t`` stacked in group-rank order (torch >= 2.12 names it
    all_gather_single; all_gather_into_tensor before)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(-1), t.contiguous().view(-1), group=group)  # flat: gloo checks dim 0 only


def reduce_scatter(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` = this rank's slice of the group's summed ``t`` (reduce_scatter_single, formerly
    reduce_scatter_tensor)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out.view(-1), t.contiguous().view(-1), group=group)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's (b, heads, s_local, d) shards, K/V passed around the ring
    (module docstring). ``chunks[r]``: the chunks rank r holds."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, cp: int,
                rank: int, chunks: Sequence[Chunks], scale: float) -> torch.Tensor:
        merge = _Merge(q, chunks[rank], scale)
        kv = torch.stack([k, v])
        for step in range(cp):
            merge.add(kv[0], kv[1], chunks[(rank - step) % cp])
            if step < cp - 1:
                kv = send_recv(kv, (rank + 1) % cp, (rank - 1) % cp, group)
        out, lse = merge.result()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.cp, ctx.rank, ctx.chunks, ctx.scale = group, cp, rank, chunks, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # noqa: ANN205
        q, k, v, out, lse = ctx.saved_tensors
        group, cp, rank, chunks, scale = ctx.group, ctx.cp, ctx.rank, ctx.chunks, ctx.scale
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        for step in range(cp):
            src = (rank - step) % cp
            dkv = dkv + _block_backward(dout, q, out, lse, chunks[rank], kv[0], kv[1], chunks[src], scale, dq)
            dkv = send_recv(dkv, (rank + 1) % cp, (rank - 1) % cp, group)  # on with its block; home after cp
            if step < cp - 1:
                kv = send_recv(kv, (rank + 1) % cp, (rank - 1) % cp, group)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


class AllGatherAttention(torch.autograd.Function):
    """Causal attention of this rank's shards against the all-gathered K/V (module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, cp: int,
                rank: int, chunks: Sequence[Chunks], scale: float) -> torch.Tensor:
        kv = torch.stack([k, v]).contiguous()
        gathered = torch.empty((cp, *kv.shape), dtype=kv.dtype, device=kv.device)
        all_gather(gathered, kv, group)
        merge = _Merge(q, chunks[rank], scale)
        for src in range(cp):
            merge.add(gathered[src][0], gathered[src][1], chunks[src])
        out, lse = merge.result()
        ctx.save_for_backward(q, gathered, out, lse)
        ctx.group, ctx.cp, ctx.rank, ctx.chunks, ctx.scale = group, cp, rank, chunks, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # noqa: ANN205
        q, gathered, out, lse = ctx.saved_tensors
        group, cp, rank, chunks, scale = ctx.group, ctx.cp, ctx.rank, ctx.chunks, ctx.scale
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv_all = torch.stack([_block_backward(dout, q, out, lse, chunks[rank], gathered[src][0], gathered[src][1],
                                               chunks[src], scale, dq) for src in range(cp)])
        mine = torch.empty(dkv_all.shape[1:], dtype=torch.float32, device=q.device)
        reduce_scatter(mine, dkv_all.contiguous(), group)
        return dq.to(q.dtype), mine[0].to(gathered.dtype), mine[1].to(gathered.dtype), None, None, None, None, None
