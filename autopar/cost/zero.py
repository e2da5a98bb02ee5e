"""Data-parallel and ZeRO traffic and gradient memory, as the executor (and Megatron-Core) run them.

Over the ``dp x cp`` group of N ranks, for P parameters on a rank, d bytes of the training dtype and
M micro-batches per step:

=====  ===============================================  =============================================
zero   collectives                                      mechanism
=====  ===============================================  =============================================
0      all-reduce P d once per step (bucketed, behind   DDP / replicate
       the last backward)
1      reduce-scatter P d once per step (behind the     FSDP2 without resharding, gradient sync only
       last backward) + all-gather P d once per step    on the last micro-batch (Megatron: the
       (behind the first forward where the software     distributed optimizer)
       overlaps it, else after the optimizer)
2      reduce-scatter P d in every micro-batch's        FSDP2 reshard_after_forward=False: the
       backward + all-gather P d in every micro-        parameters are freed after each backward,
       batch's forward (both prefetched)                so each forward gathers them again
3      all-gather forward and backward + reduce-        FSDP2 fully_shard per block
       scatter, every micro-batch
=====  ===============================================  =============================================

So ZeRO-1's traffic per step does not depend on M, ZeRO-2's grows with it; ZeRO-2 keeps 1/N of the
gradients and ZeRO-1 a whole gradient buffer -- in fp32 when training in 16 bits and M > 1 (FSDP2
accumulates unsharded gradients in its reduce dtype, Megatron in its fp32 main-grad buffer).

At pp > 1 torch.distributed.pipelining's stage defers an FSDP module's gradient sync to the step's
last backward and keeps its parameters gathered between micro-batches (``set_requires_gradient_sync``
and ``set_reshard_after_backward`` in PipelineStage), so ZeRO-2 runs as ZeRO-1 there
(``autopar.layout.executed_zero``, the one copy of the rule): priced, explained and searched as ZeRO-1.
ZeRO-3 keeps its per-micro-batch reduce-scatter and resharding there: the executor turns the
stage's switches off for ZeRO-3 modules (``executor/data_parallel.sync_every_microbatch``), so it
holds ZeRO-3's memory and is priced as ZeRO-3 at any pp.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from autopar.cost.comm import GroupLink, collective_time_s
from autopar.cost.framework import dp_wrapper, grad_reduce_bytes, trains_under_autocast
from autopar.cost.memory import StateBytes, state_bytes_per_param
from autopar.layout import executed_zero

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.cost.terms import Config

DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket: the last one cannot overlap backward
DDP_FIRST_BUCKET_BYTES = 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: DDP's first bucket is small
FP32_BYTES = 4


def ddp_bucket_sizes(grad_bytes: float) -> tuple[tuple[float, int], ...]:
    """DDP's gradient all-reduces per step at its default caps (first bucket 1 MiB, then 25 MiB
    each, the rest in the last), as ``((bytes, count), ...)``: a 175 B model holds hundreds of
    equal buckets, priced once each size, not once each bucket (the search builds terms for
    thousands of configurations). Tensor boundaries are not modelled."""
    if grad_bytes <= 0:
        return ()
    first = min(grad_bytes, float(DDP_FIRST_BUCKET_BYTES))
    full, tail = divmod(grad_bytes - first, DDP_BUCKET_BYTES)
    sizes = [(first, 1)] + ([(float(DDP_BUCKET_BYTES), int(full))] if full else []) + ([(tail, 1)] if tail > 0 else [])
    return tuple(sizes)


def ddp_fixed_sync_s(params: float, dtype_bytes: int, per_param_sync_s: float, link: GroupLink) -> float:
    """What DDP's gradient all-reduce costs beyond its bandwidth term ``params * per_param_sync_s``
    when it does not overlap backward: each bucket is one collective and pays its own latency and
    rendezvous (on the CPU profile of a 2 M-parameter model, 7.5 MiB of gradients in two buckets:
    2 x 2.9 ms beside 7.5 ms of bandwidth). Priced only where the whole sync is exposed: with
    overlap, the buckets before the last hide and the last is ``per_step_sync``'s floor."""
    total = params * dtype_bytes
    buckets_s = sum(count * collective_time_s("all_reduce", b, link) for b, count in ddp_bucket_sizes(total))
    return max(0.0, buckets_s - params * per_param_sync_s)


def overlapped(comm_s: float, window_s: float, cost_fraction: float) -> float:
    """Time a collective adds when run behind ``window_s`` of compute: what sticks out, plus the
    share of the hidden part that contention for SMs and memory bandwidth costs."""
    return max(0.0, comm_s - window_s) + cost_fraction * min(comm_s, window_s)


def per_microbatch_exposed(cfg: "Config", params: float, fwd_s: float, bwd_s: float, link: GroupLink,
                           cluster: "Cluster", host_copy_s: float = 0.0) -> float:
    """ZeRO-2/3 collectives of one micro-batch of a piece holding ``params`` parameters, each
    prefetched behind the compute of its own pass (module docstring); 0 for ZeRO-0/1. The
    all-gather moves the training dtype, the reduce-scatter the software's reduce dtype
    (framework.grad_reduce_bytes). ``host_copy_s`` (FSDP2's CPU offload): the host copy of
    this piece's shard that runs on the same stream right before each all-gather and right after
    each reduce-scatter."""
    if cfg.zero not in (2, 3):
        return 0.0
    cost_fraction = cluster.overlap_cost_fraction
    ag = collective_time_s("all_gather", params * cfg.dtype_bytes, link) + host_copy_s
    rs = collective_time_s("reduce_scatter", params * grad_reduce_bytes(cfg, cluster), link) + host_copy_s
    if cfg.zero == 3:
        return overlapped(ag, fwd_s, cost_fraction) + overlapped(ag + rs, bwd_s, cost_fraction)
    return overlapped(ag, fwd_s, cost_fraction) + overlapped(rs, bwd_s, cost_fraction)


def per_step_sync(cfg: "Config", link: GroupLink, cluster: "Cluster") -> tuple[float, float, float]:
    """(seconds per parameter hidden behind the last backward, seconds per parameter after the
    optimizer, the last bucket that never hides) of the once-per-step DP/ZeRO collectives.

    ZeRO-1's parameter all-gather goes with the gradient reduce-scatter into the first term when the
    software overlaps it (``overlap_param_gather``: FSDP2 prefetch, Megatron --overlap-param-gather):
    it hides behind the next step's first forward, priced with the backward's window (the smaller
    of the two, so never optimistic); otherwise it runs after the optimizer (second term)."""
    if cfg.zero not in (0, 1) or link.size <= 1:
        return 0.0, 0.0, 0.0
    probe = 1e9  # parameters: a large message, as the whole gradient is one stream of buckets
    reduce_bytes = grad_reduce_bytes(cfg, cluster)

    def per_param(kind: str) -> float:
        d = cfg.dtype_bytes if kind == "all_gather" else reduce_bytes  # parameters vs gradients
        return collective_time_s(kind, probe * d, link) / probe

    floor_kind = "all_reduce" if cfg.zero == 0 else "reduce_scatter"
    floor = collective_time_s(floor_kind, DDP_BUCKET_BYTES, link)
    if cfg.zero == 0:
        return per_param("all_reduce"), 0.0, floor
    gather = per_param("all_gather")
    if cluster.overlap_param_gather:
        return per_param("reduce_scatter") + gather, 0.0, floor
    return per_param("reduce_scatter"), gather, floor


def gradient_bytes_per_param(cfg: "Config", sharded_grads: float, uses_ddp: bool) -> float:
    """Gradient bytes per parameter on a rank as the executor holds them (``sharded_grads``: the
    ZeRO formula's figure, autopar.cost.memory). ZeRO-1 accumulates whole gradients over the
    micro-batches, in fp32 when training in 16 bits, and ``replicate`` (ZeRO-0 with DTensors or a
    pipeline) holds them in its fp32 parameters' dtype; DDP (ZeRO-0 without DTensors) keeps its
    communication buckets beside the gradients (gradient_as_bucket_view is off,
    executor/parallel/data_parallel.py)."""
    if cfg.zero == 1 and cfg.dp * cfg.cp > 1 and cfg.num_microbatches > 1 and cfg.dtype_bytes < FP32_BYTES:
        return float(FP32_BYTES)
    if dp_wrapper(cfg) == "replicate" and cfg.dtype_bytes < FP32_BYTES:
        return float(FP32_BYTES)  # FSDP2's replicate: gradients in the fp32 parameters' dtype
    if cfg.zero == 0 and uses_ddp:
        return 2 * sharded_grads
    return sharded_grads


def fp32_shards(cfg: "Config", cluster: "Cluster") -> bool:
    """Whether FSDP2 stores each parameter's shard in fp32 beside a 16-bit compute dtype, as the
    executor's ``fully_shard`` at ZeRO-2/3 does (its mixed-precision policy: fp32 parameters,
    ``param_dtype`` 16-bit): the shard is the optimizer's master -- no 16-bit shard is stored, the
    cast happens as FSDP2 gathers -- and the gradient shard takes the sharded parameter's dtype,
    fp32, not the training dtype the ZeRO formula counts (autopar.cost.memory). Rehearsed on
    examples/gpt_small.py at dp 2 (docs/results.md): ZeRO-2 held 4 bytes of gradient shard per
    parameter over 2 ranks where the formula priced 2 (-5.7 % of tensor bytes); ZeRO-3 the same
    total with the master in the parameters. Not under host offload of the states (the executor then
    keeps 16-bit device parameters, cost/offload.py) nor with a gradient buffer of the software's own
    (``Cluster.main_grad_bytes``) or a master of another precision (``master_weight_bytes``)."""
    # ZeRO-1 with one micro-batch and no pipeline reduces inside its one backward, as ZeRO-2 does
    one_backward = cfg.zero == 1 and cfg.num_microbatches == 1 and cfg.pp == 1
    return (dp_wrapper(cfg) == "fully_shard" and (executed_zero(cfg.zero, cfg.pp) >= 2 or one_backward)
            and cfg.dtype_bytes < FP32_BYTES and not cfg.offload.states
            and not cluster.main_grad_bytes and cluster.master_weight_bytes is None)


def with_fp32_shards(state: StateBytes, cfg: "Config", cluster: "Cluster", shard_degree: int) -> StateBytes:
    """``state`` (per parameter, sharded over ``shard_degree`` ranks) as FSDP2 holds it where it
    stores fp32 shards (``fp32_shards``): the gradient shard in fp32 (4 / N), the master counted
    with the parameters (+ 4 / N, - 4 / N of the optimizer's), and at ZeRO-3 no 16-bit shard
    (- d / N: FSDP2 casts as it gathers; ZeRO-2's whole 16-bit copies stay). ZeRO-3's total is the
    ZeRO formula's; ZeRO-2 holds (4 - d) / N more. Unchanged elsewhere."""
    if not fp32_shards(cfg, cluster):
        return state
    n, d = max(1, shard_degree), float(cfg.dtype_bytes)
    shard16 = d / n if executed_zero(cfg.zero, cfg.pp) == 3 else 0.0
    return replace(state, params=state.params - shard16 + FP32_BYTES / n, grads=FP32_BYTES / n,
                   optimizer=state.optimizer - FP32_BYTES / n)


def autocast_states(cfg: "Config", cluster: "Cluster") -> bool:
    """Whether the executor trains ``cfg`` in 16 bits under ``torch.autocast`` over fp32 parameters
    (DDP, or one unwrapped rank: framework.trains_under_autocast): the parameters are then their own
    fp32 master -- the optimizer keeps only its moments -- and the gradients take their dtype, fp32,
    DDP's buckets too. Rehearsed on a 16-block GPT of hidden 1024 at dp 8, ZeRO-0 (DDP): 4 bytes of
    parameter, 4 of gradient and 4 of bucket per parameter, where the ZeRO formula's split priced
    2, 2 and 2 (and a 4-byte master the parameters are): -8.2 % of its tensor bytes. Not on a
    software with a gradient buffer or master of its own (``Cluster.main_grad_bytes``,
    ``master_weight_bytes``), nor under host offload of the states."""
    return (trains_under_autocast(cfg) and cfg.dtype_bytes < FP32_BYTES and not cfg.offload.states
            and not cluster.main_grad_bytes and cluster.master_weight_bytes is None)


def rank_state_bytes(cfg: "Config", cluster: "Cluster", shard_degree: int | None = None,
                     ddp_buckets: bool = True) -> StateBytes:
    """Model-state bytes per parameter on a rank as the executor holds them: the ZeRO formula's
    (autopar.cost.memory) with the gradients as the data-parallel wrap keeps them
    (``gradient_bytes_per_param``: ZeRO-1's whole fp32 accumulator, DDP's buckets; a software's own
    gradient buffer, ``Cluster.main_grad_bytes``) and, where FSDP2 stores fp32 shards, the master
    counted with the parameters and the gradient shard in fp32 (``with_fp32_shards``). ``shard_degree``:
    the ranks the states are sharded over, default dp x cp (an MoE block's experts: their edp ranks,
    cost/expert.py); ``ddp_buckets`` False: parameters DDP is told to skip, which get no bucket (the
    experts: the executor reduces them over their edp ranks itself, expert_parallel.wrap_experts)."""
    n = cfg.dp * cfg.cp if shard_degree is None else shard_degree
    state = state_bytes_per_param(zero=cfg.zero, shard_degree=n, dtype_bytes=cfg.dtype_bytes,
                                  optimizer=cfg.optimizer, moment_bytes=cluster.optimizer_moment_bytes,
                                  master_bytes=cluster.master_weight_bytes)
    if cluster.main_grad_bytes and cfg.zero in (0, 1):  # the software's own whole gradient buffer
        return replace(state, grads=float(cluster.main_grad_bytes))
    if autocast_states(cfg, cluster):  # fp32 parameters, their own master; fp32 gradients
        state = replace(state, params=FP32_BYTES, grads=FP32_BYTES, optimizer=state.optimizer - FP32_BYTES)
    state = replace(state, grads=gradient_bytes_per_param(cfg, state.grads, ddp_buckets and dp_wrapper(cfg) == "ddp"))
    return with_fp32_shards(state, cfg, cluster, n)


def holds_unit_grads(cfg: "Config", cluster: "Cluster") -> bool:
    """Whether the executor's wrap keeps each unit's parameter gradients, unsharded and in the
    training dtype, from the op that makes them until the unit's post-backward folds them into its
    accumulator or reduce input: FSDP2 (``fully_shard`` at any ZeRO stage, ``replicate``) does, so a
    block's backward holds its own gradients made so far (graph/live.py's Tg) and the last stage's
    holds the root unit's (the head's) until the step's backward ends. DDP and one unwrapped rank
    keep gradients as the model states count them; a gradient buffer of the software's own
    (``Cluster.main_grad_bytes``, Megatron-Core) takes each weight gradient as it is made. Under
    ZeRO-3 they sit beside the two gathered blocks (stage.build_terms): rehearsed on GPT-3-width
    blocks at dp 2, the peak in an attention core's backward holds the block's gathered parameters,
    the next block's all-gather buffer, fc1's, fc2's and proj's unsharded gradients and the head's."""
    return not cluster.main_grad_bytes and dp_wrapper(cfg) in ("fully_shard", "replicate")


def held_reduce_input_bytes_per_param(cfg: "Config", cluster: "Cluster") -> float:
    """Bytes per block parameter of the gradient reduce-scatter input FSDP2 still holds while the
    next block's backward runs: it keeps the last reduce-scatter's flat input, in the reduce dtype
    (fp32, data_parallel.py), alive until the next unit's reduce (``FSDPParamGroup``'s
    ``reduce_scatter_states``, at most ``reduce_scatter_max_input_buffers`` = 1 by default), so the
    allocator cannot hand it out while the collective may still read it. It is in the peak where
    gradients are reduce-scattered block by block inside backward: ZeRO-3 at any pp, ZeRO-1/2
    without a pipeline (ZeRO-1 on its last micro-batch). At pp > 1 ZeRO-1/2 reduce after the last
    backward, when the activations are gone; software with a gradient buffer of its own
    (``Cluster.main_grad_bytes``, Megatron-Core) reduces in place. Measured by rehearsal (Llama-3
    405B, ZeRO-3: 11.9 GiB, a block's 3.2 B parameters in fp32). ``replicate`` (ZeRO-0 with
    DTensors or a pipeline) is FSDP2 with a unit per block as well, all-reducing the same flat fp32
    input: in the peak without a pipeline (the last micro-batch's backward), after it with one
    (the pipelining stage reduces once the step's backwards are done)."""
    if cluster.main_grad_bytes or dp_wrapper(cfg) not in ("fully_shard", "replicate"):
        return 0.0
    return float(FP32_BYTES) if executed_zero(cfg.zero, cfg.pp) == 3 or cfg.pp == 1 else 0.0


def describe(cfg: "Config", asked_zero: int) -> str:
    """One line on what the ZeRO stage holds and sends, as the executor runs it (for explain)."""
    n, m = cfg.dp * cfg.cp, cfg.num_microbatches
    if n <= 1:
        return "zero: no data-parallel group, nothing to shard"
    ran = "" if asked_zero == cfg.zero else f" (zero {asked_zero} runs as zero {cfg.zero} at pp > 1)"
    if cfg.zero == 0:
        return f"zero 0{ran}: whole states on each of {n} ranks; one gradient all-reduce per step"
    if cfg.zero == 1:
        fp32 = " in fp32" if m > 1 and cfg.dtype_bytes < FP32_BYTES else ""
        over = f"accumulated{fp32} over {m} micro-batches" if m > 1 else "one micro-batch, nothing accumulated"
        return (f"zero 1{ran}: whole parameters and gradients ({over}), "
                f"optimizer states 1/{n}; one reduce-scatter + one all-gather per step, whatever the micro-batches")
    if cfg.zero == 2:
        return (f"zero 2{ran}: gradients and optimizer states 1/{n}; a reduce-scatter and an all-gather in each "
                f"of the {m} micro-batches")
    return f"zero 3{ran}: everything 1/{n}; parameters gathered forward and backward in each of the {m} micro-batches"
