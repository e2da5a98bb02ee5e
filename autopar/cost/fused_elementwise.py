"""Element-wise time of a transformer block as fused kernels run it (``software.fused_elementwise``).

autopar's executor runs the model file eagerly: each norm, rotation, activation and residual add
is as many kernels as the file writes (an fp32 RMSNorm alone is a cast, a square, a mean, a
reciprocal root and two products), and autopar.cost.compute prices each by the bytes it moves.
Megatron-Core with Transformer Engine runs the *architecture* with fused kernels instead, each
reading its inputs and writing its outputs once. Its element-wise traffic is a function of the
block's widths (``autopar.cost.megatron_memory.layer_widths``), not of how a model file writes
the same maths -- the eager count of a Llama block is about four times the fused one.

Per token of one layer, with d the dtype's bytes, H = d h / sp the residual stream (sequence
sharded under SP), q and kv the query and key/value widths, F1 and F2 the MLP activation's input
and output widths, all wide quantities divided by t = tp:

    forward   2 norms (read x, write y)                       4 H
              2 residual adds, bias and dropout fused         6 H  (+ 1-byte masks, h / sp each)
              rotary embedding of q and k (read, write)       2 d (q + kv) / t   where the block rotates
              MLP activation (SwiGLU, GeLU, squared ReLU)     d (F1 + F2) / t
    backward  2 norms (read x, dy; write dx) + residual sums  12 H
              2 dropouts (read dy, mask; write dx)            4 H  (+ masks)     where p > 0
              rotary embedding                                2 d (q + kv) / t
              MLP activation (read input, dy; write dx)       d (2 F1 + F2) / t

each at the profile's HBM bandwidth times ``memory_efficiency``, plus one kernel launch per fused
kernel. The rotation is found by behaviour: element-wise work on the head-sharded projections
between the attention's input projections and its kernel (RoPE, written with cos/sin, complex
products or rotate-half). Sources: Megatron-LM megatron/core/fusions (bias-dropout-add, bias
SwiGLU / GeLU, apply_rope_fusion), TransformerEngine's LayerNormLinear / RMSNorm kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from autopar.cost.fused_moe import moe_traffic, moe_widths
from autopar.cost.megatron_memory import LayerWidths, layer_widths
from autopar.cost.memo import IdentityMemo

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.graph.model_graph import ModelGraph
    from autopar.graph.scaling import Shape

# Ops of a norm, found by behaviour between q/k's projections and the attention kernel: a square
# (an RMSNorm written eagerly) or a norm kernel.
NORM_OPS = frozenset({"pow", "native_layer_norm", "_fused_rms_norm", "rms_norm", "var_mean"})
FWD_KERNELS = 6  # 2 norms, 2 residual adds, rotation, activation
BWD_KERNELS = 8  # 2 norm backwards, 2 residual sums, 2 dropout backwards, rotation, activation


@dataclass(frozen=True, kw_only=True)
class FusedTraffic:
    """Bytes per token of one layer's fused element-wise kernels at tp = sp = 1, split into the
    residual-stream part (divided by sp) and the head/ffn-sharded part (divided by tp)."""

    fwd_stream_bytes: float
    fwd_wide_bytes: float
    bwd_stream_bytes: float
    bwd_wide_bytes: float
    fwd_kernels: int = FWD_KERNELS
    bwd_kernels: int = BWD_KERNELS


def traffic_of(w: LayerWidths, dtype_bytes: int, rotates: bool, qk_norm: bool = False) -> FusedTraffic:
    """The module docstring's table for widths ``w``; ``qk_norm``: the block normalises q and k
    (TE's RMSNorm on each: read, write forward; read x, dy, write dx backward)."""
    d, h = dtype_bytes, w.hidden
    q = w.attn_out
    kv = (w.attn_in - w.attn_out) / 2
    rot = 2 * d * (q + kv) if rotates else 0.0
    norm_fwd, norm_bwd = (2 * d * (q + kv), 3 * d * (q + kv)) if qk_norm else (0.0, 0.0)
    masks = w.dropouts * h  # one byte per element
    return FusedTraffic(
        fwd_stream_bytes=10 * d * h + masks,
        fwd_wide_bytes=rot + norm_fwd + d * (w.mlp_in + w.mlp_mid),
        bwd_stream_bytes=12 * d * h + w.dropouts * (2 * d * h) + masks,
        bwd_wide_bytes=rot + norm_bwd + d * (2 * w.mlp_in + w.mlp_mid),
        fwd_kernels=FWD_KERNELS + 2 * qk_norm,
        bwd_kernels=BWD_KERNELS + 2 * qk_norm,
    )


def moe_block_traffic(graph: "ModelGraph") -> FusedTraffic | None:
    """An MoE block's fused traffic (autopar.cost.fused_moe): the dense layer's kernels around it
    (a shared expert's activation in place of the MLP's) plus the router, permutations and the
    experts' weighted activation; None where its widths cannot be read."""
    w = moe_widths(graph)
    if w is None:
        return None
    dense = traffic_of(w.dense, graph.dtype_bytes, rotates(graph), qk_normed(graph))
    if w.dense.mlp_mid and not w.shared_sharded:  # a replicated shared expert works on the shard
        shared_fwd = graph.dtype_bytes * (w.dense.mlp_in + w.dense.mlp_mid)
        shared_bwd = graph.dtype_bytes * (2 * w.dense.mlp_in + w.dense.mlp_mid)
        dense = replace(dense, fwd_stream_bytes=dense.fwd_stream_bytes + shared_fwd,
                        fwd_wide_bytes=dense.fwd_wide_bytes - shared_fwd,
                        bwd_stream_bytes=dense.bwd_stream_bytes + shared_bwd,
                        bwd_wide_bytes=dense.bwd_wide_bytes - shared_bwd)
    m = moe_traffic(w, graph.dtype_bytes)
    return replace(dense, fwd_stream_bytes=dense.fwd_stream_bytes + m.fwd_stream_bytes,
                   fwd_wide_bytes=dense.fwd_wide_bytes + m.fwd_wide_bytes,
                   bwd_stream_bytes=dense.bwd_stream_bytes + m.bwd_stream_bytes,
                   bwd_wide_bytes=dense.bwd_wide_bytes + m.bwd_wide_bytes,
                   fwd_kernels=dense.fwd_kernels + m.kernels, bwd_kernels=dense.bwd_kernels + m.kernels)


_TRAFFIC: IdentityMemo[FusedTraffic | None] = IdentityMemo(1000)


def block_traffic(graph: "ModelGraph") -> FusedTraffic | None:
    """The fused traffic of ``graph``'s block (None: not a dense transformer layer whose widths
    can be read, see ``layer_widths``; such a block keeps its eager pricing)."""

    def build() -> FusedTraffic | None:
        w = layer_widths(graph)
        if w is None:
            return moe_block_traffic(graph) if graph.moe is not None else None
        return traffic_of(w, graph.dtype_bytes, rotates(graph), qk_normed(graph))

    return _TRAFFIC.get((graph,), None, build)


def rotates(graph: "ModelGraph") -> bool:
    """Whether the block transforms its queries/keys element-wise between their projections and
    the attention kernel: head-sharded (tp-divided) element-wise ops there -- a rotary embedding."""
    fwd = [op for op in graph.regions["block"].ops if op.phase == "fwd"]
    attn = next((i for i, op in enumerate(fwd) if op.kind == "attn"), None)
    first = next((i for i, op in enumerate(fwd) if op.kind == "gemm"), None)
    if attn is None or first is None or first > attn:
        return False
    return any(op.kind == "mem" and op.bytes_exps.s > 0.5 and op.bytes_exps.t > 0.5 for op in fwd[first:attn])


def qk_normed(graph: "ModelGraph") -> bool:
    """Whether the block normalises its queries and keys (a norm on the head-sharded projections
    between the attention's input projections and its kernel)."""
    fwd = [op for op in graph.regions["block"].ops if op.phase == "fwd"]
    core = next((i for i, op in enumerate(fwd) if op.kind == "attn"), None)
    first = next((i for i, op in enumerate(fwd) if op.kind == "gemm"), None)
    if core is None or first is None or first > core:
        return False
    return any(op.kind == "mem" and op.name in NORM_OPS and op.bytes_exps.t > 0.5 for op in fwd[first:core])


def fused_times_s(t: FusedTraffic, cluster: "Cluster", shape: "Shape", seq_len: int) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's fused element-wise kernels at ``shape``."""
    tokens = shape.b * shape.s_ratio * seq_len
    bw = cluster.memory_bandwidth_bytes_per_s * cluster.memory_efficiency
    fwd = tokens * (t.fwd_stream_bytes / shape.sp + t.fwd_wide_bytes / shape.t) / bw
    bwd = tokens * (t.bwd_stream_bytes / shape.sp + t.bwd_wide_bytes / shape.t) / bw
    return fwd + t.fwd_kernels * cluster.kernel_overhead_s, bwd + t.bwd_kernels * cluster.kernel_overhead_s
