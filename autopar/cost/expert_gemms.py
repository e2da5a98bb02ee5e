"""Which of an MoE block's traced GEMMs are its experts', read by behaviour: the rows of one
expert's GEMM are one expert's tokens (tokens x top_k / E at the traced shape, growing with the
micro-batch and the sequence), a grouped GEMM's rows grow with the tokens; and whether the model's
TP plan shards the experts. Read by the expert-parallel cost (autopar.cost.expert) and by the fused
MoE layer's widths (autopar.cost.fused_moe); it imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.graph.model_graph import ModelGraph
    from autopar.graph.scaling import FitOp


def token_axis(op: "FitOp", per_expert: float) -> int | None:
    """The dimension of GEMM ``op`` that counts one expert's tokens (it scales with micro-batch and
    sequence, and is tokens x top_k / E at the traced shape), or None: not an expert GEMM."""
    if op.kind != "gemm" or op.dims is None or op.dims_exps is None:
        return None
    for axis in (1, 2, 3):
        e = op.dims_exps[axis]
        if abs(e.b - 1.0) < 0.25 and abs(e.s - 1.0) < 0.25 and abs(op.dims[axis] - per_expert) < 0.5:
            return axis
    return None


def grouped_rows_axis(op: "FitOp") -> int | None:
    """The dimension of a grouped expert GEMM (torch's ``_grouped_mm``) that grows with the tokens."""
    if op.kind != "gemm" or op.name != "_grouped_mm" or op.dims is None or op.dims_exps is None:
        return None
    return next((a for a in (1, 2, 3) if abs(op.dims_exps[a].b - 1.0) < 0.25 and abs(op.dims_exps[a].s - 1.0) < 0.25),
                None)


def is_expert_gemm(graph: "ModelGraph", op: "FitOp") -> bool:
    """Whether ``op`` is one of the block's expert GEMMs: its rows are one expert's tokens, or a
    grouped GEMM's rows grow with the tokens."""
    moe = graph.moe
    if moe is None or op.kind != "gemm":
        return False
    per_expert = graph.seq_len * moe.top_k / moe.num_experts
    return ((per_expert < graph.seq_len and token_axis(op, per_expert) is not None)
            or grouped_rows_axis(op) is not None)


def experts_tp_sharded(graph: "ModelGraph") -> bool:
    """Whether the graph's TP plan shards the experts' weights (Megatron-Core's expert tensor
    parallelism: a plain-torch MoE's expert Linears, colwise/rowwise), rather than leaving them
    whole on every tp rank (HF Mixtral's stacked experts, which then compute redundantly). A
    block list's plan is ``tp_styles``; a chain with a plan per unit kind, the plan of the kind
    holding the experts (``moe_tp_styles``)."""
    if graph.moe is None:
        return False
    paths = graph.moe.paths or (graph.moe.experts_path,)
    styles = graph.moe_tp_styles if graph.chain else graph.tp_styles
    return any(k == p or k.startswith(p + ".") for p in paths for k in styles)
