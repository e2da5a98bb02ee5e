"""Activation memory as Megatron-Core with Transformer Engine keeps it (``activation_memory: megatron``).

autopar's executor runs the model file as written, so its activations are the model's own saved
tensors, measured on meta (graph/trace.py, graph/live.py). Megatron-Core runs the *architecture*
with its own fused layers, which keep less: a profile of that software (``h100-80g-megatron``)
prices a transformer block from the widths of its projections, read off the measured GEMMs
(``layer_widths``), and what each Megatron/TE module saves for backward (Megatron-LM and
TransformerEngine sources, as read in docs/cost-model.md):

* ``LayerNormLinear`` (the fused pre-attention and pre-MLP norm + first projection): the norm's
  input (the residual stream) and its output, both the *local* sequence shard under sequence
  parallelism (the output is re-gathered in backward);
* fused attention (cuDNN / flash): q, k, v (k and v at the KV-heads' width), its output (the
  output projection's input, the same tensor) and the fp32 softmax statistics per head; no score
  matrix, no dropout mask (regenerated from the RNG state);
* the MLP: its activation function's input (the first projection's output: 2 ffn wide for SwiGLU,
  ffn for GeLU / squared ReLU) and the second projection's input;
* a dropout mask (1 byte) per hidden-width dropout with p > 0, as the measured block has them;
* context parallelism (TE's P2P ring): one received K/V chunk more per layer.

Per token of one layer, with h the hidden width, widths from ``LayerWidths``, d the dtype's bytes,
t = tp and sp = tp with sequence parallelism (else 1):

    d (4 h) / sp + masks h / sp + d (attn_in + attn_out + mlp_in + mlp_mid) / t + 4 heads / t

Recompute: selective (Megatron checkpoints the core attention: with a fused kernel only its fp32
statistics are not kept), full (the layer's input, d h / sp; one layer's activations while it is
re-run). The last stage keeps the final norm's input and output and the vocabulary-parallel
cross-entropy's fp32 softmax, 4 V / t per token (megatron/core/tensor_parallel/cross_entropy.py),
and while the loss runs it also holds the bf16 logits (forward) or their gradient (backward),
2 V / t per token. The first stage keeps the token ids (int64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.cost.memo import IdentityMemo

if TYPE_CHECKING:
    from autopar.cost.terms import Config
    from autopar.graph.model_graph import ModelGraph

FP32_BYTES = 4
TOKEN_ID_BYTES = 8  # int64 token ids


@dataclass(frozen=True, kw_only=True)
class LayerWidths:
    """A transformer block's widths, from its projections (``layer_widths``)."""

    hidden: int  # h: the residual stream
    attn_in: int  # the attention's input projections' outputs: q + k + v
    attn_out: int  # the attention's output, the output projection's input (heads x head dim)
    mlp_in: int  # the MLP's first projections' outputs: 2 ffn gated (SwiGLU), ffn otherwise
    mlp_mid: int  # the MLP's second projection's input: ffn
    heads: int
    dropouts: int  # hidden-width dropouts with p > 0 in one block
    vocab: int  # the output head's width (0: no head GEMM found)


_WIDTHS: IdentityMemo[LayerWidths | None] = IdentityMemo(1000)


def layer_widths(graph: "ModelGraph") -> LayerWidths | None:
    """``measure_widths`` of ``graph``, once per graph (the search prices ~10^4 configurations)."""
    return _WIDTHS.get((graph,), None, lambda: measure_widths(graph))


def measure_widths(graph: "ModelGraph") -> LayerWidths | None:
    """The block's widths from its forward GEMMs at the measured base shape (batch 1, S tokens):
    the projections out of the hidden width h before the attention kernel (or its score GEMMs)
    are the attention's inputs, the first projection after it back into h is its output
    projection, then the MLP's projections out of h and the next one back into h. None when the
    block is not a dense transformer layer of that form (experts, a chain, no attention): such
    models keep their measured activations."""
    if graph.moe is not None or graph.chain or not graph.is_sequence_model or not graph.num_heads:
        return None
    hidden = block_width(graph)
    fwd = [op for op in graph.regions["block"].ops if op.phase == "fwd"]
    core = next((i for i, op in enumerate(fwd) if op.kind == "attn"
                 or (op.kind == "gemm" and op.dims is not None and op.dims[0] > 1)), None)
    if core is None:
        return None
    linears = [(i, op.dims[2], op.dims[3]) for i, op in enumerate(fwd)
               if op.kind == "gemm" and op.dims is not None and op.dims[0] == 1]
    attn_in = sum(n for i, n, k in linears if i < core and k == hidden)
    after = [(n, k) for i, n, k in linears if i > core]
    back = [j for j, (n, _) in enumerate(after) if n == hidden]
    if len(back) < 2 or attn_in == 0:
        return None
    attn_out, mlp_mid = after[back[0]][1], after[back[1]][1]
    mlp_in = sum(n for n, k in after[back[0] + 1:back[1]] if k == hidden)
    if attn_in <= attn_out or mlp_in <= 0:
        return None
    dropouts = sum(1 for op in graph.regions["block"].ops
                   if op.phase == "fwd" and op.name == "native_dropout" and not op.bytes_exps.quadratic)
    return LayerWidths(hidden=hidden, attn_in=attn_in, attn_out=attn_out, mlp_in=mlp_in, mlp_mid=mlp_mid,
                       heads=graph.num_heads, dropouts=dropouts, vocab=head_width(graph, hidden))


def block_width(graph: "ModelGraph") -> int:
    """The hidden width h a block reads: its input bytes per token at the measured base shape."""
    return round(graph.block_input_bytes / (graph.seq_len * graph.dtype_bytes))


def vocab_width(graph: "ModelGraph") -> int:
    """The output head's width (the vocabulary) out of the blocks' width (0: no head GEMM found,
    or a graph with no sequence to read the width off)."""
    if not graph.seq_len or not graph.dtype_bytes:
        return 0
    return head_width(graph, block_width(graph))


def head_width(graph: "ModelGraph", hidden: int) -> int:
    """The output head's width: the widest forward GEMM out of ``hidden`` after the blocks (0: none)."""
    head = [op.dims[2] for op in graph.regions["post"].ops
            if op.phase == "fwd" and op.kind == "gemm" and op.dims is not None and op.dims[3] == hidden]
    return max(head, default=0)


@dataclass(frozen=True, kw_only=True)
class MegatronActivations:
    """Bytes one micro-batch keeps on one rank (module docstring)."""

    block: float  # one layer, as the config recomputes it
    block_working: float  # a recomputed layer's activations while it re-runs (full recompute)
    pre: float
    post: float
    post_peak: float  # what the loss holds beyond that while it runs


def megatron_activations(w: LayerWidths, cfg: "Config", dtype_bytes: int, recompute: str) -> MegatronActivations:
    """Per micro-batch activations of ``cfg`` as Megatron-Core + TE keep them (module docstring)."""
    t = cfg.tp
    sp = cfg.tp if cfg.sequence_parallel and cfg.tp > 1 else 1
    tokens = cfg.micro_batch * cfg.seq_len / cfg.cp
    d, h = dtype_bytes, w.hidden
    wide = d * (w.attn_in + w.attn_out + w.mlp_in + w.mlp_mid) / t
    if cfg.cp > 1 and cfg.cp_kind == "ring":  # TE's P2P ring keeps the last received K/V chunk
        wide += d * (w.attn_in - w.attn_out) / t
    per_token = d * 4 * h / sp + w.dropouts * h / sp + wide
    stats = FP32_BYTES * w.heads / t
    full_layer = tokens * (per_token + stats)
    if recompute == "full":
        block, working = tokens * d * h / sp, full_layer
    elif recompute == "selective":
        block, working = tokens * per_token, 0.0
    else:
        block, working = full_layer, 0.0
    post = tokens * (d * 2 * h / sp + FP32_BYTES * w.vocab / t)
    return MegatronActivations(block=block, block_working=working, pre=tokens * TOKEN_ID_BYTES, post=post,
                               post_peak=tokens * d * w.vocab / t)
