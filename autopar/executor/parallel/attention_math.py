"""One ring / all-gather attention piece (executor/parallel/ring_attention.py) without a flash kernel:
what runs where the device's flash kernel cannot take the piece.

CUDA's flash kernel (FlashAttention-2, ``_scaled_dot_product_flash_attention``) takes fp16 and bf16
only, and head dims up to 256; the CPU's takes any floating dtype. An fp32 plan with ring or
all-gather context parallelism on GPUs therefore cannot run a piece on it. These two functions give
the same contract as the flash pair -- ``(out, lse)`` forward, and the backward of one piece given
the *merged* output and log-sum-exp (so the pieces' gradients add up to the full attention's) --
computed with explicit scores in fp32 (fp64 stays fp64), autocast off.

Memory: nothing beyond flash attention's q, k, v, output and log-sum-exp is saved for backward, so
what the step holds stays linear in the local sequence, as with the kernel. The explicit scores are
transient, and taken a block of query rows at a time so that a block's few score-sized tensors stay
within ``BLOCK_BYTES`` (a 16k-token chunk's scores at 32 heads would be 32 GiB at once).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

BLOCK_BYTES = 256 * 2**20  # one query block's score-sized tensors (about four live at once)
_LIVE = 4  # scores, probabilities and (backward) their gradient and a temporary


def _no_autocast(t: torch.Tensor) -> AbstractContextManager:
    """Autocast off on ``t``'s device: an fp32 piece stays fp32 also where the backward runs inside
    a training loop's autocast region (autocast would cast its matmuls to 16 bits)."""
    device = t.device.type
    return torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else nullcontext()


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype the piece is computed in: fp32, or the input's where it is wider (fp64 tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def query_blocks(q: torch.Tensor, n_keys: int, budget: int | None = None) -> list[slice]:
    """Query-row slices whose score-sized tensors, (b, heads, rows, n_keys) in the accumulation
    dtype, ``_LIVE`` at a time, fit ``budget`` bytes (``BLOCK_BYTES``); at least one row each."""
    b, h, s_q = q.shape[0], q.shape[1], q.shape[2]
    row_bytes = b * h * n_keys * torch.finfo(_acc(q)).bits // 8 * _LIVE
    rows = max(1, (BLOCK_BYTES if budget is None else budget) // max(1, row_bytes))
    return [slice(r, min(r + rows, s_q)) for r in range(0, s_q, rows)]


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, first_row: int) -> torch.Tensor:
    """scale * q k^T in the accumulation dtype for query rows starting at ``first_row``; a causal
    piece (query and key chunk at the same positions) masks every key after its query."""
    s = torch.matmul(q.to(_acc(q)), k.to(_acc(q)).transpose(-2, -1)) * scale
    if causal:
        rows = torch.arange(first_row, first_row + s.shape[-2], device=s.device)[:, None]
        later = torch.arange(s.shape[-1], device=s.device)[None, :] > rows
        s = s.masked_fill(later, float("-inf"))
    return s


def math_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
               budget: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse in the accumulation dtype) of softmax(scale q k^T) v for one piece;
    q, k, v (b, heads, s, d) with equal heads (the caller repeats grouped K/V) and v's head dim
    padded to q's, as for the flash kernel. ``budget``: bytes per query block (``query_blocks``)."""
    outs, lses = [], []
    with _no_autocast(q):
        for rows in query_blocks(q, k.shape[-2], budget):
            s = _scores(q[:, :, rows], k, causal, scale, rows.start)
            lse = torch.logsumexp(s, dim=-1)
            outs.append(torch.matmul(torch.exp(s - lse[..., None]), v.to(s.dtype)).to(q.dtype))
            lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def math_piece_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float, budget: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one piece given the merged ``out`` and ``lse`` of the whole query shard
    (the flash backward's contract): P = exp(scores - lse) is the piece's share of the full softmax,
    and rowsum(dout * out) over the merged output makes dq, dk the piece's share of the full
    attention's gradient. dk, dv are summed over the query blocks in the accumulation dtype."""
    acc = _acc(q)
    dqs = []
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    with _no_autocast(q):
        kf, vf = k.to(acc), v.to(acc)
        for rows in query_blocks(q, k.shape[-2], budget):
            qb, do = q[:, :, rows].to(acc), dout[:, :, rows].to(acc)
            p = torch.exp(_scores(qb, kf, causal, scale, rows.start) - lse[:, :, rows].to(acc)[..., None])
            dv += torch.matmul(p.transpose(-2, -1), do)
            ds = p * (torch.matmul(do, vf.transpose(-2, -1)) - (do * out[:, :, rows].to(acc)).sum(-1, keepdim=True))
            dqs.append((torch.matmul(ds, kf) * scale).to(q.dtype))
            dk += torch.matmul(ds.transpose(-2, -1), qb) * scale
    return torch.cat(dqs, dim=2), dk.to(k.dtype), dv.to(v.dtype)
