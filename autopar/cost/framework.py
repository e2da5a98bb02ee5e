"""What FSDP2 and DTensor cost beyond their collectives: CPU time per parameter tensor.

The collectives of ZeRO are priced by bytes (autopar.cost.zero). The software around them costs
per *tensor*: each ``fully_shard`` unit's all-gather copies every shard into one buffer and splits
the result back into per-parameter views, each reduce-scatter does the reverse, and every
optimizer op on a DTensor parameter goes through DTensor's dispatch. On a GPU this runs ahead of
the kernels and mostly hides; on CPU ranks (gloo) it is the rank's own time: measured on 2 gloo
ranks, a 35-tensor, 2 M-parameter decoder's ZeRO-1 step cost ~60 ms more than its ZeRO-0 step,
against ~5 ms of collectives priced by bytes.

A profile measured with ``autopar profile --comm`` holds three figures (``measured.comm.fsdp``,
autopar.profiler.fsdp), each the time beyond what the cost model already charges:

    g  gather_s_per_tensor      per tensor per all-gather of its unit (forward)
    r  reduce_s_per_tensor      per tensor per reduce-scatter (or all-reduce) of its unit (backward)
    o  optimizer_s_per_tensor   per DTensor parameter per optimizer step

Priced as the executor runs (autopar/executor/parallel/data_parallel.py; T the parameter tensors of a piece):

    ZeRO-2 (pp = 1) / ZeRO-3, per micro-batch:  forward + g T;  backward + r T (ZeRO-3: + (g + r) T)
    ZeRO-1 (and ZeRO-2 at pp > 1), per step:     (g + r) T, plus each unit's collective latency
                                                 (FSDP2 issues one reduce-scatter and one all-gather
                                                 per unit; the byte pricing counts the gradient as
                                                 one stream, so no per-call latency)
    FSDP2 ``replicate`` (ZeRO-0 at tp or pp > 1), per step: r T
    any DTensor parameters (FSDP2, replicate, tp > 1), per step: o T

Per-step figures enter the step's tail per parameter (``StageTerms.framework_s_per_param``), like
the optimizer, so the split ILP stays linear; a profile without the figures prices nothing here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost.comm import GroupLink, collective_time_s
from autopar.layout import executed_zero

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.cost.terms import Config


def dp_wrapper(cfg: "Config") -> str:
    """How the executor wraps a part for data parallelism over dp x cp (data_parallel.wrap_kind):
    ``fully_shard`` (ZeRO-2/3, or ZeRO-1 with more than one rank), ``replicate`` (ZeRO-0 with
    DTensor parameters or a pipeline, on one data-parallel rank too), ``ddp`` or ``none`` (one
    rank, no tp, no pipeline)."""
    n = cfg.dp * cfg.cp
    if cfg.zero >= 2 or (cfg.zero == 1 and n > 1):
        return "fully_shard"
    if cfg.tp > 1 or cfg.pp > 1:
        return "replicate"
    return "none" if n == 1 else "ddp"


def trains_under_autocast(cfg: "Config") -> bool:
    """Whether the executor trains ``cfg`` under ``torch.autocast`` over fp32 parameters (DDP, or a
    part on one data-parallel rank) rather than through FSDP2's mixed-precision policy
    (``fully_shard`` and ``replicate``: data_parallel.MIXED_PRECISION_KINDS)."""
    return dp_wrapper(cfg) in ("ddp", "none")


def grad_reduce_bytes(cfg: "Config", cluster: "Cluster") -> float:
    """Bytes per gradient element the data-parallel reduction sends: a Megatron profile's gradient
    buffer dtype (``main_grad_bytes``, reduced in place), else the software's reduce dtype
    (``grad_reduce_bytes``: autopar run's fp32), else the training dtype."""
    if cluster.main_grad_bytes:
        return float(cluster.main_grad_bytes)
    if cluster.grad_reduce_bytes:
        return float(cluster.grad_reduce_bytes)
    return float(cfg.dtype_bytes)


def has_dtensor_params(cfg: "Config") -> bool:
    """Whether the optimizer steps DTensor parameters (FSDP2 shards, replicate, tensor parallel)."""
    return cfg.tp > 1 or dp_wrapper(cfg) in ("fully_shard", "replicate")


def per_microbatch_s(cfg: "Config", cluster: "Cluster", tensors: int) -> tuple[float, float]:
    """(forward, backward) seconds one micro-batch of a piece with ``tensors`` parameter tensors adds."""
    if dp_wrapper(cfg) != "fully_shard" or tensors <= 0:
        return 0.0, 0.0
    zero = executed_zero(cfg.zero, cfg.pp)
    g, r = cluster.fsdp_gather_s_per_tensor, cluster.fsdp_reduce_s_per_tensor
    if zero == 3:
        return g * tensors, (g + r) * tensors
    if zero == 2:
        return g * tensors, r * tensors
    return 0.0, 0.0


def per_step_s_per_param(cfg: "Config", cluster: "Cluster", *, tensors: int, params: float, units: int,
                         link: GroupLink) -> float:
    """Per-step seconds per parameter of a rank (module docstring) for a model of ``tensors``
    parameter tensors and ``params`` parameters in ``units`` FSDP2 units; 0 without the profile's
    figures or without parameters."""
    if params <= 0 or tensors <= 0:
        return 0.0
    kind = dp_wrapper(cfg)
    total = cluster.dtensor_optimizer_s_per_tensor * tensors if has_dtensor_params(cfg) else 0.0
    measured = cluster.fsdp_gather_s_per_tensor + cluster.fsdp_reduce_s_per_tensor > 0
    if kind == "fully_shard" and executed_zero(cfg.zero, cfg.pp) == 1:
        total += (cluster.fsdp_gather_s_per_tensor + cluster.fsdp_reduce_s_per_tensor) * tensors
        if measured:  # a profile that measured FSDP2's own costs: its per-unit calls too
            total += units * (collective_time_s("reduce_scatter", 1.0, link) + collective_time_s("all_gather", 1.0, link))
    elif kind == "replicate":
        total += cluster.fsdp_reduce_s_per_tensor * tensors
    return total / params
