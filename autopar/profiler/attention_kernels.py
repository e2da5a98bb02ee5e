"""Fused-attention throughput of the local GPU: the measured profile's attention table.

``autopar profile --device cuda`` times torch's flash SDPA (the kernel ``autopar run`` calls for
16-bit attention) over the grid the shipped attention table was read from (the FlashAttention-3
paper's: 512-16k keys, head dimension 64 and 128, 16k tokens per call at width 2048, causal and
full masks, forward and backward) and writes one row per point; the cost model then prices every
fused attention from this GPU's own rates in place of the published ones
(autopar.kernel_tables.attention_table_from_rows, autopar.cluster.with_measured).

A rate is in torch's FLOP count, the trace's (``torch.utils.flop_counter``: the forward's two
matmuls over the whole s x s scores whatever the mask, the backward's five), so a causal kernel's
rate reads about twice its useful one, as the published table's causal rates do once converted.
The backward is timed as forward + backward minus forward.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from autopar.profiler.kernels import _time
from autopar.torch_dtypes import TORCH_DTYPES

CUDA_ATTENTION_SEQ = (512, 1024, 2048, 4096, 8192, 16384)  # key lengths (the FA3 paper's)
HEAD_DIMS = (64, 128)
TOKENS_PER_CALL = 16384  # batch x keys of one timed call (the paper's)
WIDTH = 2048  # heads x head dimension (the paper's)


def _flash_only(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """On CUDA the flash backend alone: the rows are that kernel's or none (an error, not a slower
    kernel's rate under its name)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _times_s(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, device: torch.device,
             warmup: int, repeats: int) -> tuple[float, float, torch.Size]:
    """(forward seconds, forward + backward seconds, output shape) of one SDPA call."""
    with _flash_only(device):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grad = torch.randn_like(out)

        def fwd() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).detach()

        def fwd_bwd() -> None:
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), grad)

        return _time(fwd, device, warmup, repeats), _time(fwd_bwd, device, warmup, repeats), out.shape


def attention_curve(device: torch.device, dtype: str, *, seqs: Sequence[int] = CUDA_ATTENTION_SEQ,
                    head_dims: Sequence[int] = HEAD_DIMS, tokens: int = TOKENS_PER_CALL, width: int = WIDTH,
                    warmup: int = 2, repeats: int = 5) -> list[dict[str, Any]]:
    """One row per (head dimension, key length, mask, direction): {direction, mask, head_dim,
    kv_tokens, seconds, flops_per_s} (module docstring). The small-grid arguments are for tests."""
    dt = TORCH_DTYPES[dtype]
    rows = []
    for hd in head_dims:
        heads = max(1, width // hd)
        for s in seqs:
            b = max(1, tokens // s)
            q, k, v = (torch.randn(b, heads, s, hd, device=device, dtype=dt, requires_grad=True) for _ in range(3))
            for causal in (False, True):
                fwd_s, both_s, out_shape = _times_s(q, k, v, causal, device, warmup, repeats)
                flops = {"forward": float(sdpa_flop_count(q.shape, k.shape, v.shape)),
                         "backward": float(sdpa_backward_flop_count(out_shape, q.shape, k.shape, v.shape))}
                seconds = {"forward": fwd_s, "backward": max(both_s - fwd_s, 1e-3 * both_s)}
                for direction in ("forward", "backward"):
                    rows.append({"direction": direction, "mask": "causal" if causal else "full", "head_dim": hd,
                                 "kv_tokens": s, "seconds": seconds[direction],
                                 "flops_per_s": flops[direction] / seconds[direction]})
    return rows
