"""Element-wise time of a mixture-of-experts layer as Megatron-Core runs it (``software.fused_elementwise``).

A Hugging Face MoE block, run eagerly, routes with a dozen small kernels (a softmax, a top-k, a
sort, a histogram), gathers each token's rows with an index, applies SiLU and the gate product as
two kernels, scales every expert row by its routing weight in another, and scatters the rows back
with index_put / index_add -- each of them priced by its bytes (autopar.cost.compute), which on
Mixtral 8x22B is a third of a layer's time. Megatron-Core with ``--moe-permute-fusion``,
``--moe-router-fusion`` and its fused weighted SwiGLU (megatron/core/transformer/moe:
token_dispatcher.MoEAlltoAllTokenDispatcher, moe_utils.permute / unpermute / sort_chunks_by_idxs
on Transformer Engine's moe_permute kernels, experts.TEGroupedMLP with weighted_bias_swiglu_impl,
router's fused top-k with its score function) runs the same layer as a few kernels, each reading
its inputs and writing its outputs once. Their traffic is a function of the layer's widths, not
of how a model file writes them.

Per token of one layer, d the dtype's bytes, h the hidden width, k the routed experts per token
(top-k, balanced routing: every rank holds k rows per token of its shard whatever ep is), E the
experts, F1 and F2 one expert's activation input and output widths (2 f and f for SwiGLU), the
router's scores and probabilities in fp32 (4 bytes) as the fused router computes them:

    forward   router: read E logits, write E probabilities, E routing-map bytes, E aux-loss scores  (d + 9) E
              permute: gather k rows of h (read, write), their k probabilities                    2 k d h + 8 k
              weighted SwiGLU: read F1 and the probability, write F2, per row                     k d (F1 + F2) + 4 k
              unpermute: read k rows, write the token's sum                                       (k + 1) d h
    backward  the same kernels' gradients: unpermute (read the token's, write k rows)             (1 + k) d h
              weighted SwiGLU (read input, dy, probability; write dx, d probability)              k d (2 F1 + F2) + 8 k
              permute (read k rows' gradients, write the token's)                                  (k + 1) d h + 8 k
              router (read dprobs and probs, write d logits)                                       (8 + d) E

plus, around the layer, the dense part of a transformer layer: its two norms, two residual adds,
the rotary embedding of q and k (autopar.cost.fused_elementwise's table) and a norm of q and k
where the block has one (Qwen3's --qk-layernorm), and a shared expert's activation (its widths
from its projections). The rows sit on the routing rank's shard (sequence parallelism folds the
tokens, autopar.layout), so they count with the residual stream (divided by sp); experts the TP
plan shards (expert tensor parallelism) have their activation width divided by tp instead.

What depends on ep is added where ep is priced (autopar.cost.expert's ``expert_sort_s``): with
more than one local expert the all-to-all dispatcher sorts the received rows by local expert and
restores their order after the experts (``sort_chunks_by_idxs``): 2 k d h each way, forward and
backward. At ep 1 permute already groups the rows by expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.cost.expert_gemms import experts_tp_sharded, is_expert_gemm
from autopar.cost.megatron_memory import LayerWidths, block_width

if TYPE_CHECKING:
    from autopar.graph.model_graph import ModelGraph
    from autopar.graph.scaling import FitOp

SCORE_BYTES = 4  # Megatron's fused router computes scores and probabilities in fp32 (moe_router_fusion)
# router, permute, weighted activation, unpermute: one fused kernel each, in forward and in backward
MOE_KERNELS = 4
SORT_KERNELS = 2  # sort_chunks_by_idxs before the experts and its restore after them


@dataclass(frozen=True, kw_only=True)
class MoeWidths:
    """An MoE block's widths (``moe_widths``): the attention's, the experts', a shared expert's."""

    dense: LayerWidths  # hidden, attention, a shared expert's activation (mlp_in / mlp_mid: 0 without one)
    shared_sharded: bool  # the TP plan shards the shared expert (its activation width / tp)
    experts: int  # E
    top_k: int  # k
    expert_in: int  # F1: one expert's activation input (its first projections' outputs)
    expert_mid: int  # F2: its second projection's input
    experts_sharded: bool  # the TP plan shards the experts (expert tensor parallelism)


@dataclass(frozen=True, kw_only=True)
class MoeTraffic:
    """Bytes per token (tp = sp = 1) of an MoE layer's fused kernels beyond the dense layer's:
    ``stream`` with the routing rank's rows (divided by sp), ``wide`` sharded by tp."""

    fwd_stream_bytes: float
    fwd_wide_bytes: float
    bwd_stream_bytes: float
    bwd_wide_bytes: float
    kernels: int  # per pass


def _fwd(graph: "ModelGraph") -> list["FitOp"]:
    return [op for op in graph.regions["block"].ops if op.phase == "fwd"]


def _linear(op: "FitOp") -> bool:
    return op.kind == "gemm" and op.dims is not None and op.dims[0] == 1


def _projections(gemms: list["FitOp"], hidden: int) -> tuple[int, int, list["FitOp"]]:
    """(F1, F2, the up projections) of an MLP's forward GEMMs, one MLP's or several experts' in
    order: the last GEMM back into h is a down projection (F2 its input), every GEMM of its shape
    another expert's; the others out of h are up projections, F1 their outputs per down
    projection. Where every GEMM has the down projection's shape (F1 = F2 = h), one MLP's last
    GEMM is its down projection and the others its up projections. (0, 0, []) without a
    projection back into h."""
    downs = [op for op in gemms if op.dims[2] == hidden]
    if not downs:
        return 0, 0, []
    last = downs[-1].dims
    ups = [op for op in gemms if op.dims[3] == hidden and op.dims != last]
    n_down = sum(1 for op in gemms if op.dims == last)
    if not ups:  # one MLP whose projections all look alike
        ups, n_down = gemms[:-1], 1
    return sum(op.dims[2] for op in ups) // n_down, last[3], ups


def moe_widths(graph: "ModelGraph") -> MoeWidths | None:
    """The widths of ``graph``'s MoE block, read off its forward GEMMs at the base shape: the
    attention's input projections out of h before the attention kernel, its output projection
    (the first GEMM after it back into h), the experts' GEMMs (autopar.cost.expert_gemms: the rows
    that grow with the tokens), and a shared expert's projections (the other GEMMs out of h after the
    attention, but the router's E scores and a one-wide gate). None: not a sequence model's MoE
    block of that form (a chain's units, grouped stacks the model routes itself: priced as traced)."""
    moe = graph.moe
    if moe is None or graph.chain or not graph.is_sequence_model or not graph.num_heads or "block" not in graph.regions:
        return None
    if len(moe.paths) > 1:  # grouped stacks called by the model's own routing code (JetMoE): not that form
        return None
    hidden = block_width(graph)
    fwd = _fwd(graph)
    core = next((i for i, op in enumerate(fwd) if op.kind == "attn"), None)
    if core is None:
        return None
    attn_in = sum(op.dims[2] for op in fwd[:core] if _linear(op) and op.dims[3] == hidden)
    at = next((i for i in range(core, len(fwd)) if _linear(fwd[i]) and fwd[i].dims[2] == hidden), None)
    if at is None or attn_in <= fwd[at].dims[3]:
        return None
    out, after = fwd[at], fwd[at + 1:]
    experts = [op for op in after if is_expert_gemm(graph, op)]
    expert_in, mid, ups = _projections(experts, hidden)
    if len(ups) == len(experts) - 1 and len(experts) > 2:  # several experts' GEMMs all alike: their weights decide
        expert_in = round(moe.params_per_expert / hidden) - mid
    if not mid or expert_in <= 0:
        return None
    shared = [op for op in after if _linear(op) and not is_expert_gemm(graph, op)
              and op.dims[2] not in (moe.num_experts, 1)]  # not the router's E scores, nor a one-wide gate
    shared_in, shared_mid, shared_up = _projections(shared, hidden)
    dropouts = sum(1 for op in fwd if op.name == "native_dropout" and not op.bytes_exps.quadratic)
    dense = LayerWidths(hidden=hidden, attn_in=attn_in, attn_out=out.dims[3], mlp_in=shared_in if shared_mid else 0,
                        mlp_mid=shared_mid if shared_in else 0, heads=graph.num_heads, dropouts=dropouts, vocab=0)
    return MoeWidths(dense=dense, shared_sharded=any(op.dims_exps is not None and op.dims_exps[2].t > 0.5
                                                     for op in shared_up),
                     experts=moe.num_experts, top_k=moe.top_k, expert_in=expert_in, expert_mid=mid,
                     experts_sharded=experts_tp_sharded(graph))


def moe_traffic(w: MoeWidths, dtype_bytes: int) -> MoeTraffic:
    """The module docstring's table for widths ``w`` (without the ep-dependent sort)."""
    d, h, k, e = dtype_bytes, w.dense.hidden, w.top_k, w.experts
    probs = SCORE_BYTES * k
    act_fwd = k * d * (w.expert_in + w.expert_mid) + probs
    act_bwd = k * d * (2 * w.expert_in + w.expert_mid) + 2 * probs
    move_fwd = (d + 2 * SCORE_BYTES + 1) * e + 2 * k * d * h + 2 * probs + (k + 1) * d * h
    move_bwd = (1 + k) * d * h + (k + 1) * d * h + 2 * probs + (2 * SCORE_BYTES + d) * e
    if w.experts_sharded:
        return MoeTraffic(fwd_stream_bytes=move_fwd, fwd_wide_bytes=act_fwd, bwd_stream_bytes=move_bwd,
                          bwd_wide_bytes=act_bwd, kernels=MOE_KERNELS)
    return MoeTraffic(fwd_stream_bytes=move_fwd + act_fwd, fwd_wide_bytes=0.0, bwd_stream_bytes=move_bwd + act_bwd,
                      bwd_wide_bytes=0.0, kernels=MOE_KERNELS)


def sort_bytes_per_token(graph: "ModelGraph", ep: int) -> float:
    """Bytes per token of the routing rank's shard that the all-to-all dispatcher's two chunk sorts
    move in one pass (forward or backward) at ``ep``: 0 with one local expert (nothing to sort) or
    one ep rank (permute already grouped the rows by expert)."""
    moe = graph.moe
    if moe is None or ep <= 1 or moe.num_experts // ep <= 1:
        return 0.0
    hidden = graph.block_input_bytes / (graph.seq_len * graph.dtype_bytes)
    return 2 * 2 * moe.top_k * graph.dtype_bytes * hidden
