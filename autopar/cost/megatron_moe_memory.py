"""An MoE layer's activations as Megatron-Core keeps them (``activation_memory: megatron``).

A Hugging Face MoE block run eagerly saves what its ops save: the gathered rows of each expert's
index, the fp32 routing weights, SiLU's input and the gate product's two, the scatter's indices.
Megatron-Core runs the same layer with Transformer Engine's fused modules, and what they keep for
backward is a function of the layer's widths (read off the block's GEMMs by
``autopar.cost.fused_moe.moe_widths``), per token of a rank's micro-batch, d the dtype's bytes:

* the attention half and both norms as a dense layer keeps them (``megatron_memory``), the
  pre-MLP norm being a separate ``TENorm`` whose input and output (the router's and the
  dispatcher's input) are the same 2 h the dense formula counts; a shared expert is a dense MLP
  there (its ``mlp_in`` / ``mlp_mid``), sharded by tp, or on the sequence shard where replicated;
* where the block normalises q and k (``--qk-layernorm``): TE's norm keeps its input, the
  projections' q and k, d (q + k) / tp beside the normalised ones the attention keeps;
* the router (on the rank's sequence shard, / sp): TE's fused top-k with its score function keeps
  the E-wide boolean routing map and its fp32 intermediate scores
  (transformer_engine/pytorch/router.py, ``FusedTopkScoreFunction``), the fused aux-loss scores
  another E fp32, and the fused permute's row map, E int64 (TE 2.1-2.4 ``make_row_id_map``:
  [E, tokens]; 2 E + 1 int32 since): 17 E bytes. The router GEMM's input is the norm's output,
  already counted; its fp32 logits are consumed by the fused top-k, not kept;
* the expert rows, k per token (balanced routing: every ep rank receives tokens x k rows of its
  sequence shard whatever ep; the busiest rank ``moe_imbalance`` times that): fc1's input, the
  permuted rows (k h, kept by TE's grouped linear), fc1's output (k F1, kept by the weighted
  SwiGLU, megatron/core/fusions/fused_bias_swiglu.py ``weighted_bias_swiglu_impl``) with the
  permuted fp32 probabilities (4 k), and the activation's output (k F2, fc2's input) -- dropped
  by ``--recompute-modules moe_act``, which reruns the activation from fc1's output
  (experts.py, ``CheckpointWithoutOutput``). Nothing else of the exchange is kept: TE's
  ``moe_permute`` / ``moe_unpermute`` and ``moe_sort_chunks_by_index`` keep index maps only,
  the all-to-alls nothing, and the routing weight is applied inside the SwiGLU, so the unpermute
  keeps no expert output (token_dispatcher.py, ``MoEAlltoAllTokenDispatcher``: ``unpermute``
  without probs). The sort's int32 maps (8 k bytes) are left out (under 0.1 % of a row's bytes).
  Without expert tensor parallelism the rows are the sequence shard's (/ sp); with it (the TP plan
  shards the experts) the dispatcher gathers the rows over tp, so fc1's input is whole and F1, F2
  are / tp.

``--recompute-modules layernorm`` drops the pre-MLP norm's output, d h / sp (the attention's norm
is fused into its first projection, ``TELayerNormColumnParallelLinear``, and not recomputed:
transformer_layer.py recomputes only norms that are not an ``IdentityOp``). No plan field carries
these two modules (``parallel.recompute`` names none, selective or full for the whole layer), so
``stage.build_terms`` prices without them; ``moe_activations`` takes them by keyword.

Selective and full recompute are the dense layer's: the core attention's statistics, or the
layer's input while one layer re-runs with everything above.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from autopar.cost.fused_elementwise import qk_normed
from autopar.cost.fused_moe import SCORE_BYTES, MoeWidths, moe_widths
from autopar.cost.megatron_memory import MegatronActivations, head_width, layer_widths, megatron_activations
from autopar.cost.memo import IdentityMemo

if TYPE_CHECKING:
    from autopar.cost.terms import Config
    from autopar.graph.model_graph import ModelGraph

ROUTING_MAP_BYTES = 1  # torch.bool routing map [tokens, E] the fused top-k keeps
ROW_MAP_BYTES = 8  # TE's permute row map: int64 [E, tokens] (2.1-2.4), int32 [tokens, 2 E + 1] since
# per expert per routed token: the map, the top-k's fp32 intermediate scores, the aux loss's fp32 scores,
# the permute's row map
ROUTING_BYTES_PER_EXPERT = ROUTING_MAP_BYTES + 2 * SCORE_BYTES + ROW_MAP_BYTES


_MOE: IdentityMemo[tuple[MoeWidths, bool] | None] = IdentityMemo(1000)


def _moe_layer(graph: "ModelGraph") -> tuple[MoeWidths, bool] | None:
    """(widths, whether q and k are normalised) of ``graph``'s MoE block, once per graph (the search
    prices ~10^4 configurations); None: not an MoE block whose widths can be read."""
    def read() -> tuple[MoeWidths, bool] | None:
        w = moe_widths(graph) if graph.moe is not None else None
        return None if w is None else (replace(w, dense=replace(w.dense, vocab=head_width(graph, w.dense.hidden))),
                                       qk_normed(graph))
    return _MOE.get((graph,), None, read)


def moe_bytes_per_token(w: MoeWidths, cfg: "Config", dtype_bytes: int, *, qk_norm: bool,
                        layernorm: bool = False, moe_act: bool = False) -> float:
    """What an MoE layer keeps beyond the dense layer formula of ``w.dense`` (its attention, norms
    and a tp-sharded shared expert), per token of the rank's micro-batch (module docstring).
    ``layernorm`` / ``moe_act``: Megatron's ``--recompute-modules`` of those names."""
    d, h, k = dtype_bytes, w.dense.hidden, w.top_k
    t = cfg.tp
    sp = cfg.tp if cfg.sequence_parallel and cfg.tp > 1 else 1
    extra = 0.0
    if qk_norm:  # q is heads x head dim (the attention's output width), k and v share the rest
        extra += d * (w.dense.attn_out + (w.dense.attn_in - w.dense.attn_out) / 2) / t
    if w.dense.mlp_mid and not w.shared_sharded:  # a replicated shared expert on the sequence shard
        extra += d * (w.dense.mlp_in + w.dense.mlp_mid) / sp
    extra += ROUTING_BYTES_PER_EXPERT * w.experts / sp
    mid = 0 if moe_act else w.expert_mid
    if w.experts_sharded:  # expert tp: the rows (and their probabilities) gathered over tp, the widths sharded
        rows = d * h + SCORE_BYTES + d * (w.expert_in + mid) / t
    else:
        rows = (d * (h + w.expert_in + mid) + SCORE_BYTES) / sp
    extra += k * rows * cfg.moe_imbalance
    if layernorm:
        extra -= d * h / sp
    return extra


def moe_activations(w: MoeWidths, cfg: "Config", dtype_bytes: int, recompute: str, *, qk_norm: bool,
                    layernorm: bool = False, moe_act: bool = False) -> MegatronActivations:
    """Per micro-batch activations of ``cfg`` for an MoE layer of widths ``w`` (``w.dense.vocab``:
    the head's, priced on the last stage) as Megatron-Core keeps them (module docstring)."""
    dense_w = w.dense
    if dense_w.mlp_mid and not w.shared_sharded:  # counted on the shard in moe_bytes_per_token
        dense_w = replace(dense_w, mlp_in=0, mlp_mid=0)
    dense = megatron_activations(dense_w, cfg, dtype_bytes, recompute)
    tokens = cfg.micro_batch * cfg.seq_len / cfg.cp
    extra = tokens * moe_bytes_per_token(w, cfg, dtype_bytes, qk_norm=qk_norm, layernorm=layernorm,
                                         moe_act=moe_act)
    if recompute == "full":  # the layer's input only; everything while it re-runs
        return replace(dense, block_working=dense.block_working + extra)
    return replace(dense, block=dense.block + extra)


def megatron_block_activations(graph: "ModelGraph", cfg: "Config") -> MegatronActivations | None:
    """Megatron-Core's activations of ``cfg`` for ``graph``'s block: a dense transformer layer's
    (``megatron_memory``) or an MoE layer's; None where the block is of neither form (it keeps its
    measured activations)."""
    dense = layer_widths(graph)
    if dense is not None:
        return megatron_activations(dense, cfg, cfg.dtype_bytes, cfg.recompute)
    moe = _moe_layer(graph)
    if moe is None:
        return None
    return moe_activations(moe[0], cfg, cfg.dtype_bytes, cfg.recompute, qk_norm=moe[1])
