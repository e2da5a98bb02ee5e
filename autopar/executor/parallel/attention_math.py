"""One ring / all-gather attention piece (executor/parallel/ring_attention.py) without a flash kernel:
what runs where the device's flash kernel cannot take the piece.

CUDA's flash kernel (FlashAttention-2, ``_scaled_dot_product_flash_attention``) takes fp16 and bf16
only, and head dims up to 256; the CPU's takes any floating dtype. An fp32 plan with ring or
all-gather context parallelism on GPUs therefore cannot run a piece on it. These two functions give
the same contract as the flash pair -- ``(out, lse)`` forward, and the backward of one piece given
the *merged* output and log-sum-exp (so the pieces' gradients add up to the full attention's) --
computed with explicit scores in fp32 (fp64 stays fp64).

Memory: one piece's scores and probabilities, (b, heads, s_q, s_k) each, live while the piece runs
and are freed after it; nothing beyond flash attention's q, k, v, output and log-sum-exp is saved
for backward, so what the step holds stays linear in the local sequence, as with the kernel.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def _no_autocast(t: torch.Tensor) -> AbstractContextManager:
    """Autocast off on ``t``'s device: an fp32 piece stays fp32 also where the backward runs inside
    a training loop's autocast region (autocast would cast its matmuls to 16 bits)."""
    device = t.device.type
    return torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else nullcontext()


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype the piece is computed in: fp32, or the input's where it is wider (fp64 tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """scale * q k^T in the accumulation dtype; a causal piece (query and key chunk at the same
    positions, so s_q == s_k) masks every key after its query."""
    s = torch.matmul(q.to(_acc(q)), k.to(_acc(q)).transpose(-2, -1)) * scale
    if causal:
        n_q, n_k = s.shape[-2], s.shape[-1]
        later = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(later, float("-inf"))
    return s


def math_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse in the accumulation dtype) of softmax(scale q k^T) v for one piece;
    q, k, v (b, heads, s, d) with equal heads (the caller repeats grouped K/V) and v's head dim
    padded to q's, as for the flash kernel."""
    with _no_autocast(q):
        s = _scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None])
        return torch.matmul(p, v.to(s.dtype)).to(q.dtype), lse


def math_piece_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one piece given the merged ``out`` and ``lse`` of the whole query shard
    (the flash backward's contract): P = exp(scores - lse) is the piece's share of the full softmax,
    and rowsum(dout * out) over the merged output makes dq, dk the piece's share of the full
    attention's gradient."""
    acc = _acc(q)
    with _no_autocast(q):
        s = _scores(q, k, causal, scale)
        p = torch.exp(s - lse.to(acc)[..., None])
        do = dout.to(acc)
        dv = torch.matmul(p.transpose(-2, -1), do)
        dp = torch.matmul(do, v.to(acc).transpose(-2, -1))
        ds = p * (dp - (do * out.to(acc)).sum(-1, keepdim=True))
        dq = torch.matmul(ds, k.to(acc)) * scale
        dk = torch.matmul(ds.transpose(-2, -1), q.to(acc)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
