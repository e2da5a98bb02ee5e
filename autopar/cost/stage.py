"""The linear stage model: per-block and per-stage terms of one parallel configuration.

For a configuration (everything in a plan except the split of blocks into stages), every quantity
the step time and the memory depend on is either a constant or proportional to the number of blocks
a pipeline chunk holds. ``StageTerms`` holds those coefficients; the estimator evaluates them for a
given split and the ILP optimises the split over them, so both see exactly the same cost model.

Region times come from ``graph_region_time``: measured layer tables when the cluster profile has
them for this model, the roofline otherwise. The edges are costed as the executor runs them at
tp > 1 (executor/parallel/tensor_parallel.py): a vocab-parallel embedding (output all-reduced in forward)
and a vocab-parallel head whose logits stay sharded, the loss running under ``loss_parallel()``
(three per-token all-reduces in forward: max, sum of exponentials, target logit; the head's input
gradient all-reduced in backward). A measured table has the edges of one tp rank at each measured
tp (``edges_replicated: false``, looked up like the block). A table measured before that, with
``edges_replicated: true`` (embedding and head timed whole at tp = 1), keeps being priced the way
it was: edges at their tp = 1 time, with their full parameter count and no vocab-parallel
collectives.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cluster import Cluster
from autopar.cost.comm import axis_link, collective_time_s
from autopar.cost.compute import (
    RegionTime,
    bwd_grads_at,
    graph_region_time,
    peak_with_grads,
    under_autocast,
    usable_layer_table,
)
from autopar.cost.evolve import evolve
from autopar.cost.expert import ExpertTerms, adjust_terms, grads_share
from autopar.cost.framework import (
    dp_wrapper,
    grad_reduce_bytes,
    per_microbatch_s,
    per_step_s_per_param,
    trains_under_autocast,
)
from autopar.cost.megatron_memory import FP32_BYTES, vocab_width
from autopar.cost.megatron_moe_memory import megatron_block_activations
from autopar.cost.terms import Config, Part, StageTerms
from autopar.cost.zero import (
    ddp_fixed_sync_s,
    held_reduce_input_bytes_per_param,
    holds_unit_grads,
    overlapped,
    per_microbatch_exposed,
    per_step_sync,
    rank_state_bytes,
)
from autopar.graph.model_graph import ModelGraph
from autopar.graph.scaling import Shape
from autopar.layout import Layout


def keeps_autocast_copies(cluster: Cluster, cfg: Config) -> bool:
    """Whether a micro-batch keeps 16-bit copies of the weights (``Cluster.autocast_weight_copies``):
    training in 16 bits under autocast, i.e. a data-parallel kind without FSDP2's param_dtype (DDP,
    or one data-parallel rank; ``replicate`` takes FSDP2's policy)."""
    return cluster.autocast_weight_copies and cfg.dtype_bytes < 4 and trains_under_autocast(cfg)


def backward_grads_share(cfg: Config, cluster: Cluster) -> float:
    """The share of a rank's gradient memory (``state_split['grads']``) its step's backward makes:
    the executor sets gradients to None after each optimizer step (executor/runtime/train.py), so
    FSDP2's sharded, accumulated or replicated gradients and a lone rank's are made during the
    step's first backward -- absent where a rank's activations peak before it
    (``StageTerms.loss_free_grads``: one micro-batch without a pipeline, or GPipe). DDP's
    communication buckets (half its figure, ``cost.zero.gradient_bytes_per_param``) persist from
    construction, and so does a gradient buffer of the software's own (Megatron-Core's
    ``main_grad_bytes``). Rehearsals: Llama-3 8B, FSDP2 over 8 ranks, one micro-batch of 2
    (docs/results.md), no gradient at the peak; a 4-stage GPT under GPipe, none at its forwards'."""
    if cluster.main_grad_bytes or cluster.activation_memory == "megatron":
        return 0.0
    return 0.5 if dp_wrapper(cfg) == "ddp" else 1.0


def as_trained(rt: RegionTime, cluster: Cluster, cfg: Config) -> RegionTime:
    """``rt``'s activations as the executor trains ``cfg``: under autocast over fp32 parameters
    (``keeps_autocast_copies``) what CUDA's autocast keeps (``cost.compute.under_autocast``: the fp32
    residual stream, probabilities and norm inputs, a 16-bit copy per GEMM of an fp32 input), else
    the trace's. A 16-block GPT at DDP was priced 1.2-1.7 % below its rehearsal with the trace's."""
    return under_autocast(rt) if keeps_autocast_copies(cluster, cfg) else rt


def _pipeline_buffer_bytes(cfg: Config, cluster: Cluster, tokens_bytes: float, sp: float,
                           carried_bytes: float = 0.0) -> float:
    """One receive buffer of torch pipelining (``StageTerms.pipeline_buffer_bytes``): the hidden state
    a stage hands on, sequence-sharded under SP, and the values carried beside it (whole:
    ``ModelGraph.carried_bytes``), in the dtype the wrapped model computes in -- the training dtype
    under FSDP2's param_dtype (ZeRO 2-3, ZeRO-1 over more than one rank, and ``replicate``), fp32
    under the autocast of an unwrapped stage (its residual stream stays fp32)."""
    if cfg.pp == 1 or not cluster.pipeline_buffers_per_microbatch:
        return 0.0
    return _handed_bytes(cfg, tokens_bytes / sp + carried_bytes)


def _handed_bytes(cfg: Config, nbytes: float) -> float:
    """``nbytes`` of activations in the training dtype as a stage hands them on: fp32 under the
    autocast of an unwrapped stage (its residual stream stays fp32), else as they are."""
    return nbytes * (4.0 / cfg.dtype_bytes if trains_under_autocast(cfg) else 1.0)


def _handoff(graph: ModelGraph, cluster: Cluster, cfg: Config, tokens_bytes: float, sp: float) -> dict[str, float]:
    """``StageTerms.handoff_bytes`` and ``received_saved_bytes``: the hidden state one micro-batch of a
    chunk hands on (as its receive buffer holds it: ``_pipeline_buffer_bytes`` less what is carried
    beside it, passed through) where its last block does not save it already (a last ReLU saves its
    output: ModelGraph.block_saves_output; not under full or per-op recompute, which save none of the
    block's own tensors), and the same where the chunk's first block saves what it receives -- the
    model's block does (ModelGraph.block_saves_input: its first norm or GEMM reads it), and so do
    full and per-op recompute, which keep the block's input. Activation offload moves what is saved
    to the host (cost/offload.py clears the second). Set at pp = 1 too (the search's fit bound reads
    a branch's terms without a pipeline); ``StageTerms.chunk_edges`` uses them at pp > 1."""
    if not cluster.pipeline_buffers_per_microbatch:
        return {"handoff_bytes": 0.0, "received_saved_bytes": 0.0, "hidden_bytes": 0.0}
    hidden = _handed_bytes(cfg, tokens_bytes / sp)
    keeps_own = cfg.recompute not in ("full", "op")
    received = graph.block_saves_input or not keeps_own
    return {"handoff_bytes": 0.0 if keeps_own and graph.block_saves_output else hidden,
            "received_saved_bytes": hidden if received else 0.0, "hidden_bytes": hidden}


def _stage_output_bytes(graph: ModelGraph, cluster: Cluster, cfg: Config, shape: Shape, replicated: bool) -> float:
    """The model's output (the head's logits) of one micro-batch as the last pipeline stage holds it
    (``StageTerms.stage_output_bytes``): torch pipelining keeps a stage's output from its forward until
    its backward has run (``fwd_cache``), where the training loop without a pipeline lets it go once
    the loss has it (graph/build.forward_backward: the trace's live peaks do not hold it). It is what
    the model returned (``ModelGraph.output``) at this rank's shape: vocabulary-sharded where the
    head is. 0 at pp = 1 and under Megatron's schedules, which free it after the loss."""
    out = graph.output
    if cfg.pp == 1 or not cluster.pipeline_buffers_per_microbatch or out is None:
        return 0.0
    at = replace(shape, t=1.0, sp=1.0) if replicated else shape
    return out.nbytes * at.scale(out.exps)


def build_terms(graph: ModelGraph, cluster: Cluster, cfg: Config) -> StageTerms:
    """Coefficients of the step-time and memory model for ``cfg`` (see module docstring)."""
    if cfg.offload.any:  # host offload: priced over the same config's terms without offload
        from autopar.cost.offload import offloaded_terms

        return offloaded_terms(graph, cluster, cfg, build_terms)
    if cfg.recompute == "mixed":
        return _mixed_terms(graph, cluster, cfg)
    layout = Layout.of(cfg)
    S = graph.seq_len
    s_ratio = (cfg.seq_len / cfg.cp) / S if graph.is_sequence_model else 1.0
    kv_ratio = cfg.seq_len / S if graph.is_sequence_model else 1.0
    sp = float(cfg.tp) if cfg.sequence_parallel and cfg.tp > 1 else 1.0
    shape = Shape(b=cfg.micro_batch, s_ratio=s_ratio, kv_ratio=kv_ratio, t=cfg.tp, sp=sp)
    if cfg.cp > 1 and cfg.cp_kind == "ulysses":
        core_shape = Shape(b=cfg.micro_batch, s_ratio=kv_ratio, kv_ratio=kv_ratio, t=cfg.tp * cfg.cp, sp=1.0)
    else:
        core_shape = Shape(b=cfg.micro_batch, s_ratio=s_ratio, kv_ratio=kv_ratio, t=cfg.tp, sp=1.0)
    state = rank_state_bytes(cfg, cluster)
    tokens_bytes = graph.block_input_bytes * cfg.micro_batch * s_ratio  # one rank's block input, full width
    tp_link, cp_link, dpcp_link = (axis_link(cluster, layout, axis) for axis in ("tp", "cp", "dp_cp"))

    traced_rt = graph_region_time(graph, "block", cluster, shape, core_shape, cfg.cp, cfg.cp_kind)
    block_rt = _cp_flash_core(as_trained(traced_rt, cluster, cfg), graph, cfg, tokens_bytes)
    # of the block's gradients, those this rank makes (expert parallelism; a chain's units: cost/chain.py)
    share = 1.0 if graph.chain else grads_share(graph, cfg, graph.params["block"].per_rank(cfg.tp))
    block = _block_part(graph, cluster, cfg, block_rt, shape, tp_link, cp_link, dpcp_link, tokens_bytes,
                        trace_rt=_cp_flash_core(traced_rt, graph, cfg, tokens_bytes), share=share)
    if graph.chain:  # a chain's experts are priced on the units that hold them (cost/chain.py)
        ep = ExpertTerms(block=block, expert=None, transient_saving_bytes=0.0)
    else:  # experts sharded over ep ranks
        ep = adjust_terms(graph, cluster, cfg, block, dense_state_bytes=state.total, dpcp_link=dpcp_link,
                          tokens_bytes=tokens_bytes, shape=shape)
    block, expert = ep.block, ep.expert
    table = usable_layer_table(graph, cluster)
    replicated = table is not None and table.edges_replicated
    # An old table (edges measured whole at tp = 1) keeps its replicated pricing; see module docstring.
    pre = _edge_part(graph, cluster, cfg, "pre", shape, tp_link, dpcp_link, tokens_bytes, replicated=replicated)
    post = _edge_part(graph, cluster, cfg, "post", shape, tp_link, dpcp_link, tokens_bytes, with_loss=True,
                      replicated=replicated)
    # What a stage receives beside the hidden state (a carried encoder output, CLIP's first tower):
    # the executor sends it whole from every tp rank, in the same batch of sends as the hidden state.
    carried = graph.carried_bytes(cfg.micro_batch, s_ratio) if cfg.pp > 1 else 0.0
    p2p = 0.0
    if cfg.pp > 1:
        if cluster.pipeline_scatter_gather and sp == 1.0 and cfg.tp > 1:
            # Each tp rank sends 1/tp of the activation on its own rail, then the receivers all-gather it.
            p2p = collective_time_s("p2p", tokens_bytes / cfg.tp + carried, axis_link(cluster, layout, "pp")) + \
                collective_time_s("all_gather", tokens_bytes, tp_link)
        else:
            p2p = collective_time_s("p2p", tokens_bytes / sp + carried, axis_link(cluster, layout, "pp"))

    d = cfg.dtype_bytes
    n_shard = cfg.dp * cfg.cp
    per_param_sync, gather, bucket_floor = per_step_sync(cfg, dpcp_link, cluster)
    opt_params_per_rank = 1.0 / n_shard if cfg.zero >= 1 else 1.0
    optimizer_s = cluster.optimizer_bytes_per_param * opt_params_per_rank / cluster.memory_bandwidth_bytes_per_s
    block_params = graph.params["block"].per_rank(cfg.tp)
    transient = 0.0
    # FSDP2 pads each parameter's dim 0 to a multiple of the shard degree (RegionParams.padding)
    fsdp_shards = n_shard if dp_wrapper(cfg) == "fully_shard" else 1
    block_padding = graph.params["block"].padding(fsdp_shards)
    if cfg.zero == 3:
        # FSDP2 in a block's backward: the block's gathered parameters and the next one's all-gather
        # buffer, prefetched; its unsharded gradients are the block's Tg (cost.zero.holds_unit_grads)
        transient += 2 * (block_params + block_padding) * d
        transient -= ep.transient_saving_bytes  # expert parallelism: this rank's E / ep experts only
    mega = megatron_block_activations(graph, cfg) if cluster.activation_memory == "megatron" else None
    if mega is None:
        transient += _recompute_working(block_rt, cluster, cfg, share)
    else:  # Megatron-Core + TE keep their own activations (cost/megatron_memory.py, megatron_moe_memory.py)
        transient += mega.block_working
        block, pre = evolve(block, act_bytes=mega.block), evolve(pre, act_bytes=mega.pre)
        post = evolve(post, act_bytes=mega.post, peak_bytes=mega.post_peak)
    edge_tp = embedding_tp(graph, cfg, replicated)
    tied = graph.tied_params / edge_tp if cfg.pp > 1 else 0.0
    model_params = graph.num_blocks * block.params + pre.params + post.params  # a rank's share at pp = 1
    framework = per_step_s_per_param(
        cfg, cluster, tensors=sum(graph.params[r].tensors * (graph.num_blocks if r == "block" else 1)
                                  for r in ("pre", "block", "post", "loss")),
        params=model_params, units=graph.num_blocks + cfg.pp * cfg.virtual_stages, link=dpcp_link)
    fixed_sync = 0.0
    if dp_wrapper(cfg) == "ddp" and not cluster.overlap_grad_reduce and expert is None and not graph.chain:
        fixed_sync = ddp_fixed_sync_s(model_params, grad_reduce_bytes(cfg, cluster), per_param_sync, dpcp_link)
    return StageTerms(
        expert=expert,
        config=cfg, block=block, pre=pre, post=post, p2p_s=p2p,
        state_bytes_per_param=state.total,
        state_split={"params": state.params, "grads": state.grads, "optimizer": state.optimizer},
        grad_sync_s_per_param=per_param_sync,
        grad_sync_overlaps=cluster.overlap_grad_reduce,
        overlap_cost_fraction=cluster.overlap_cost_fraction,
        grad_sync_floor_s=bucket_floor,
        grad_sync_fixed_s=fixed_sync,
        param_gather_s_per_param=gather,
        optimizer_s_per_param=optimizer_s,
        framework_s_per_param=framework,
        transient_bytes=transient,
        held_reduce_bytes_per_param=held_reduce_input_bytes_per_param(cfg, cluster),
        # the root unit's (head's) gradients, held by FSDP2 until the stage's backward ends
        # (a tied head's too: the last stage's copy at pp > 1, the embedding's weight at pp = 1)
        root_grad_bytes=(post.params + graph.tied_params / edge_tp) * d if holds_unit_grads(cfg, cluster) else 0.0,
        backward_grads_share=backward_grads_share(cfg, cluster),
        gather_window=not cluster.main_grad_bytes,  # Megatron-Core's distributed optimizer keeps them all
        tied_params=tied,
        reserve_bytes=reserve_bytes(cluster, cfg, tokens_bytes),
        capacity_bytes=cluster.usable_memory_bytes,
        pipeline_buffer_bytes=_pipeline_buffer_bytes(cfg, cluster, tokens_bytes, sp, carried),
        block_padding_bytes=block_padding * d if cfg.zero in (1, 2) else 0.0,
        **_handoff(graph, cluster, cfg, tokens_bytes, sp),
        batch_bytes=graph.batch_input_bytes * cfg.global_batch / cfg.dp * (
            cfg.seq_len / graph.seq_len if graph.is_sequence_model else 1.0),
        stage_output_bytes=_stage_output_bytes(graph, cluster, cfg, shape, replicated),
        carried_bytes=carried,
        zero3_root_params_per_byte=float(d) if cfg.zero == 3 else 0.0,
        zero3_gather_bytes=(block_params + block_padding) * d if cfg.zero == 3 else 0.0,
        pre_padding_bytes=graph.params["pre"].padding(fsdp_shards) * d,
        post_padding_bytes=graph.params["post"].padding(fsdp_shards) * d,
    )


def software_recompute_reason(cluster: Cluster, mode: str) -> str | None:
    """Why the software a profile prices cannot run recompute ``mode`` (None: it can). Megatron-Core
    (``activation_memory: megatron``) checkpoints whole layers or the core attention, never per op."""
    if mode == "op" and cluster.activation_memory == "megatron":
        return ("the profile prices Megatron-Core, whose recompute is full or selective (core attention), "
                "not per op; use recompute none, selective or full")
    return None


def _recompute_working(rt: RegionTime, cluster: Cluster, cfg: Config, share: float = 1.0) -> float:
    """What recompute re-materialises while a block's backward runs: the whole block (full, and
    per-op selective, whose re-run forward saves for backward what the block saves without
    recompute -- its kept outputs among them, counted here and in the block's activations alike, a
    bound above by at most those outputs) or its attention core (selective), as the model file
    saves them; ``rt``: the block region at the config's shape; ``share``: of the block's
    gradients, those this rank makes (cost/expert.py ``grads_share``)."""
    if cfg.recompute not in ("full", "selective", "op"):
        return 0.0
    if cfg.recompute != "selective":
        return rt.saved_bytes
    # The core's forward re-runs when backward reaches it, after the ops behind it (proj, the MLP)
    # have made their weights' gradients, which FSDP2 holds to the unit's post-backward: its
    # forward temporaries meet them. The block's price holds the larger of forward's peak and Tg'
    # (taken where backward's own temporaries peak, the core's backward in an unfused attention),
    # so what the two together hold beyond it is added; the block's forward peak stands in for the
    # core's (a bound above where the block's forward peaks outside the core). Rehearsed on GPT-3
    # 175B at 64 H100s (tp 4, ZeRO-3): the softmax's re-run beside proj's, fc1's and fc2's gradients.
    beside = 0.0
    if holds_unit_grads(cfg, cluster):
        beside = max(0.0, rt.fwd_peak_bytes + bwd_grads_at(rt, share) - peak_with_grads(rt, share)[0])
    return rt.core_saved_bytes + beside


# Transformer Engine's userbuffers for TP communication overlap: one buffer of the full local
# sequence x hidden per overlapped GEMM pass (qkv, proj, fc1, fc2; forward and data-gradient),
# allocated once by initialize_ub (transformer_engine/pytorch/module/base.py).
USERBUFFERS = 8


def communicator_axes(cfg: Config) -> int:
    """NCCL communicators a rank of ``cfg`` uses: one per parallel axis of more than one rank (the
    tensor, context, data x context (gradients, ZeRO), pipeline and expert groups)."""
    return sum(n > 1 for n in (cfg.tp, cfg.cp, cfg.dp * cfg.cp, cfg.pp, cfg.ep))


def reserve_bytes(cluster: Cluster, cfg: Config, tokens_bytes: float) -> float:
    """Device memory no tensor of the step holds (cluster.py): the fixed per-process part, each NCCL
    communicator's buffers, and TE's userbuffers where TP communication overlaps its GEMMs."""
    userbuffers = USERBUFFERS * tokens_bytes if cluster.tp_comm_overlap and cfg.tp > 1 else 0.0
    return cluster.framework_reserve_bytes + cluster.nccl_bytes_per_group * communicator_axes(cfg) + userbuffers


def _mixed_terms(graph: ModelGraph, cluster: Cluster, cfg: Config) -> StageTerms:
    """Per-stage recompute: the terms of a per-rank recompute mix, each mode's block priced exactly as a
    single-mode config prices it (so a rank of one mode costs what that config costs)."""
    from autopar.plan import RECOMPUTE_MODES

    per_mode = {m: build_terms(graph, cluster, replace(cfg, recompute=m)) for m in RECOMPUTE_MODES}
    base = per_mode["none"]
    return replace(base, config=cfg, recompute_parts={m: t.block for m, t in per_mode.items()},
                   recompute_working_bytes={m: t.transient_bytes - base.transient_bytes for m, t in per_mode.items()})


def _tp_time(cluster: Cluster, cfg: Config, fit_comm, phase: str, shape: Shape, link) -> float:  # noqa: ANN001
    """Tensor-parallel collectives of one block in ``phase``: an all-reduce per recorded message,
    or with sequence parallelism an all-gather plus a reduce-scatter of the same size."""
    if cfg.tp == 1:
        return 0.0
    total = 0.0
    plain = Shape(b=shape.b, s_ratio=shape.s_ratio, kv_ratio=shape.kv_ratio, t=shape.t)
    for q in fit_comm:
        if q.phase != phase:
            continue
        nbytes = q.nbytes * plain.scale(q.exps)
        if cfg.sequence_parallel:
            total += collective_time_s("all_gather", nbytes, link) + collective_time_s("reduce_scatter", nbytes, link)
        else:
            total += collective_time_s("all_reduce", nbytes, link)
    return total


def _tp_backward_exposed(cfg: Config, tp_bwd_s: float, wgrad_window_s: float) -> float:
    """Backward TP communication left after overlap (Megatron's async tensor-parallel backward):
    the all-reduce of a column-parallel layer's input gradient runs while its weight gradient is
    computed. With sequence parallelism the all-gather that re-forms the input overlaps the same
    way, but the reduce-scatter of the input gradient (half the traffic) stays exposed."""
    if cfg.sequence_parallel:
        return tp_bwd_s / 2 + max(0.0, tp_bwd_s / 2 - wgrad_window_s)
    return max(0.0, tp_bwd_s - wgrad_window_s)


def _cp_time(graph: ModelGraph, cfg: Config, link, tokens_bytes: float) -> tuple[float, float]:  # noqa: ANN001
    """(forward, backward) exposed context-parallel communication of one block."""
    if cfg.cp == 1:
        return 0.0, 0.0
    heads, kv = graph.num_heads, graph.num_kv_heads or graph.num_heads
    kv_frac = (kv / heads) if heads else 1.0
    kv_bytes = 2 * tokens_bytes * kv_frac / cfg.tp  # this rank's K and V
    n = cfg.cp
    # The gradients of K,V travel in fp32 (executor/parallel/ring_attention.py accumulates them so).
    dkv_bytes = kv_bytes * 4 / cfg.dtype_bytes
    if cfg.cp_kind == "ring":
        # autopar's ring (executor/parallel/ring_attention.py) shifts K/V with a blocking send/receive between
        # two flash-attention pieces: the next piece needs the block being received, so nothing
        # overlaps. Forward: cp - 1 shifts of K,V. Backward: the blocks go round again (cp - 1
        # shifts; only this rank's K,V were saved) and each block's fp32 gradient travels with it,
        # cp shifts, ending at its owner.
        step = collective_time_s("p2p", kv_bytes, link)
        return (n - 1) * step, (n - 1) * step + n * collective_time_s("p2p", dkv_bytes, link)
    if cfg.cp_kind == "allgather":
        return (collective_time_s("all_gather", kv_bytes * n, link),
                collective_time_s("reduce_scatter", dkv_bytes * n, link))
    # Ulysses (executor/parallel/context_parallel.py): one all-to-all each for q, k, v and the output, each
    # of this rank's local tensor (the message of the measured fit: the tensor a rank passes in);
    # backward runs the four again, reversed.
    q_bytes = tokens_bytes / cfg.tp
    a2a = 2 * collective_time_s("all_to_all", q_bytes, link) + 2 * collective_time_s("all_to_all", kv_bytes / 2, link)
    return a2a, a2a


def _cp_flash_core(rt: RegionTime, graph: ModelGraph, cfg: Config, tokens_bytes: float) -> RegionTime:
    """The block's saved bytes under context parallelism: every cp kind runs attention on flash
    kernels (executor/parallel/ring_attention.py: ring and all-gather pieces merged by log-sum-exp;
    Ulysses' SDPA on head shards; Transformer Engine's likewise), which keep no s^2 tensors -- where
    the traced core keeps them (explicit attention: scores, probabilities, dropout masks), they are
    replaced by what a flash kernel keeps beside the q, k, v the trace counts already: its output
    and log-sum-exp (fp32 per query and head), and for the all-gather kind the gathered K/V of the
    other cp ranks. A 16-block GPT of hidden 1024 at 1,024 tokens, dp 4 cp 2 (ZeRO-1) was priced
    18.4 % above its rehearsal with the traced probabilities. Unchanged where the trace's core is
    already flash's (no quadratic saved tensor) and under a measured cp table (``rt`` as run)."""
    if cfg.cp == 1 or rt.core_saved_bytes <= 0 or rt.measured_cp:
        return rt
    heads = graph.num_heads or 1
    out = tokens_bytes / cfg.tp  # the attention's output, this rank's heads
    lse = cfg.micro_batch * (cfg.seq_len / cfg.cp) * heads / cfg.tp * FP32_BYTES
    gathered = 0.0
    if cfg.cp_kind == "allgather":
        kv_frac = (graph.num_kv_heads or heads) / heads
        gathered = cfg.cp * 2 * tokens_bytes * kv_frac / cfg.tp
    flash = out + lse + gathered
    return replace(rt, saved_bytes=rt.saved_bytes - rt.core_saved_bytes + flash, core_saved_bytes=flash)


def _block_part(graph, cluster, cfg, rt, shape, tp_link, cp_link, dpcp_link, tokens_bytes,  # noqa: ANN001
                trace_rt=None, share: float = 1.0) -> Part:  # noqa: ANN001
    """The block's Part from its region ``rt`` at the config's shape (priced once in build_terms);
    ``trace_rt``: the region with the trace's activations where ``rt`` has autocast's; ``share``: of
    the block's gradients, those this rank makes (``region_peak_bytes``)."""
    fit = graph.regions["block"]
    tp_f = _tp_time(cluster, cfg, fit.comm, "fwd", shape, tp_link)
    tp_b = _tp_time(cluster, cfg, fit.comm, "bwd", shape, tp_link)
    if cluster.tp_comm_overlap:
        # Megatron/TE userbuffers: each TP all-gather / reduce-scatter is split into chunks pipelined
        # with the GEMM that consumes or produces it, in forward and in backward alike.
        tp_f = overlapped(tp_f, rt.fwd_gemm_s, cluster.overlap_cost_fraction)
        tp_b = overlapped(tp_b, rt.bwd_gemm_s, cluster.overlap_cost_fraction)
    elif cluster.async_tp_backward:
        # Weight-gradient GEMMs are half of the backward GEMMs: the window the backward collectives hide in.
        tp_b = _tp_backward_exposed(cfg, tp_b, rt.bwd_gemm_s / 2)
    cp_f, cp_b = _cp_time(graph, cfg, cp_link, tokens_bytes)
    if cfg.cp_kind == "ring" and cluster.cp_attention == "transformer_engine":
        # TE's P2P ring sends the next K/V block (backward: with its gradient) on its own stream while
        # the current piece's attention runs: only what outlasts the attention shows, plus the
        # hidden part's share of SMs and bandwidth. autopar's ring waits for each block (_cp_time).
        cp_f = overlapped(cp_f, rt.core_fwd_s, cluster.overlap_cost_fraction)
        cp_b = overlapped(cp_b, rt.core_bwd_s, cluster.overlap_cost_fraction)
    fwd = rt.fwd_s + tp_f + cp_f
    if cfg.recompute == "full":
        recompute = fwd
    elif cfg.recompute == "selective":
        # The checkpointed core is the whole cp attention: its recompute re-runs the cp transfers too.
        recompute = rt.core_fwd_s + cp_f
    elif cfg.recompute == "op":
        # Per-op selective (autopar.recompute_ops): the block's input plus the outputs it keeps; the
        # other forward ops run again, with their collectives (SP's all-gathers; its reduce-scatters
        # are kept; without SP the all-reduces are not) and the cp transfers of attention.
        tp_again = tp_f / 2 if cfg.sequence_parallel else tp_f
        recompute = rt.fwd_s - rt.op_saved_fwd_s + tp_again + cp_f
    else:
        recompute = 0.0
    autocast = keeps_autocast_copies(cluster, cfg)
    # the block input a checkpoint keeps: the residual stream, fp32 under autocast
    act = _kept_bytes(rt, cfg, tokens_bytes * (FP32_BYTES / cfg.dtype_bytes if autocast else 1.0))
    params = graph.params["block"].per_rank(cfg.tp)
    autocast_act = 0.0  # what exists only under autocast (Part.autocast_act_bytes)
    if autocast:
        # each Linear's autocast copy of its weight is an op output that full and per-op recompute do not keep
        copies = params * cfg.dtype_bytes if cfg.recompute not in ("full", "op") else 0.0
        autocast_act = act - _kept_bytes(trace_rt or rt, cfg, tokens_bytes) + copies
        act += copies
    bwd = rt.bwd_s + tp_b + cp_b + recompute
    zero = per_microbatch_exposed(cfg, params, fwd, bwd, dpcp_link, cluster)
    zero += sum(per_microbatch_s(cfg, cluster, graph.params["block"].tensors))  # framework time: FSDP2's own time
    peak, peak_grads = region_peak_bytes(rt, cfg, cluster, share)
    return Part(fwd_s=fwd, bwd_s=bwd + zero, recompute_s=recompute, tp_comm_s=tp_f + tp_b, cp_comm_s=cp_f + cp_b,
                zero_comm_s=zero, act_bytes=act, params=params, fwd_flops=rt.fwd_flops, bwd_flops=rt.bwd_flops,
                peak_bytes=peak, peak_grads_bytes=peak_grads, autocast_act_bytes=autocast_act)


def _kept_bytes(rt: RegionTime, cfg: Config, input_bytes: float) -> float:
    """A block's activations per micro-batch under ``cfg``'s recompute mode, from its region ``rt``
    and the block input a checkpoint keeps (``input_bytes``, full width)."""
    if cfg.recompute == "full":
        return input_bytes / (cfg.tp if cfg.sequence_parallel else 1)
    if cfg.recompute == "selective":
        return rt.saved_bytes - rt.core_saved_bytes
    if cfg.recompute == "op":
        return input_bytes / (cfg.tp if cfg.sequence_parallel else 1) + rt.op_saved_bytes
    return rt.saved_bytes


def region_peak_bytes(rt: RegionTime, cfg: Config, cluster: Cluster, share: float = 1.0) -> tuple[float, float]:
    """A region's temporaries at its peak and, of them, its own parameter gradients (``Part.peak_bytes``,
    ``Part.peak_grads_bytes``): with the gradients made so far where the data-parallel wrap holds them
    until its post-backward (FSDP2: cost/zero.holds_unit_grads), without them (0) where the model
    states count them. Where the activations priced are the model file's own saved tensors
    (``activation_memory: measured``), less those backward has freed by its peak (graph/live.py's Tg'
    and T'); software with activations of its own (Megatron-Core + TE) keeps T, which frees nothing.
    ``share``: the share of the region's gradients this rank makes (cost/expert.py
    ``grads_share``: E / ep experts')."""
    if holds_unit_grads(cfg, cluster):
        return peak_with_grads(rt, share)
    if cluster.activation_memory == "measured":
        return rt.peak_credited_bytes, 0.0
    return rt.peak_bytes, 0.0


LOSS_PARALLEL_ALL_REDUCES = 3  # per token, forward: logit max, sum of exponentials, target logit
LOSS_STAT_BYTES = 4  # each an fp32 value per token (the loss's computation dtype)
# What torch's loss_parallel holds at its peak beyond the eager cross-entropy the trace runs, in fp32
# logits shards (tokens x V / tp): its decomposed log-softmax keeps x - max and its exponential where
# the fused kernel keeps one output. Measured with torch's memory tracker on a fake process group
# (tests/unit/test_loss_parallel_memory.py, which fails if a torch release changes it).
LOSS_PARALLEL_EXTRA_SHARDS = 1


def embedding_tp(graph: ModelGraph, cfg: Config, replicated: bool) -> int:
    """The tp degree dividing the embedding's weight (and a head tied to it) on a rank: tp where the
    executor shards it over the vocabulary (its parameters say so), 1 where it stays whole (an
    old table's replicated edges)."""
    return cfg.tp if graph.params["pre"].tp_sharded and not replicated else 1


def _edge_part(graph, cluster, cfg, region, shape, tp_link, dpcp_link, tokens_bytes, with_loss=False,  # noqa: ANN001
               replicated=False) -> Part:
    """The embedding (pre) or the head plus loss (post), as the executor runs them (see the module
    docstring). A vocab-parallel embedding all-reduces its output in forward; a vocab-parallel head
    all-reduces its input gradient in backward, and its loss (``loss_parallel``) all-reduces three
    per-token statistics in forward. Replicated edges (an old table, or a vocabulary tp does not
    divide) run whole on every tp rank and need none of these."""
    # The fitted tp exponents already say which ops a vocab-parallel layer shards (0 for the rest);
    # under SP the edges run on the whole sequence unless the software shards them (Cluster.sp_edges).
    if not cluster.sp_edges:
        shape = replace(shape, sp=1.0)
    t_shape = replace(shape, t=1.0, sp=1.0) if replicated else shape
    vocab_tp = not replicated and graph.shards_with_tp(region)
    parts = [as_trained(graph_region_time(graph, region, cluster, t_shape), cluster, cfg)]
    if with_loss:
        parts.append(as_trained(graph_region_time(graph, "loss", cluster, t_shape), cluster, cfg))
    fwd = sum(p.fwd_s for p in parts)
    bwd = sum(p.bwd_s for p in parts)
    tp = 0.0
    if vocab_tp and cfg.tp > 1:
        tp = collective_time_s("all_reduce", tokens_bytes, tp_link)
    if region == "pre":
        fwd += tp
    else:
        bwd += tp
    loss_parallel_bytes = 0.0
    if with_loss and vocab_tp and cfg.tp > 1:
        tokens = shape.b * shape.s_ratio * graph.seq_len  # this rank's tokens per micro-batch
        stats = LOSS_PARALLEL_ALL_REDUCES * collective_time_s("all_reduce", tokens * LOSS_STAT_BYTES, tp_link)
        fwd += stats
        tp += stats
        loss_parallel_bytes = LOSS_PARALLEL_EXTRA_SHARDS * tokens * vocab_width(graph) / cfg.tp * FP32_BYTES
    params = graph.params[region].per_rank(1 if replicated else cfg.tp)
    if region == "post":
        params += graph.params["loss"].count
    zero = per_microbatch_exposed(cfg, params, fwd, bwd, dpcp_link, cluster)
    tensors = graph.params[region].tensors + (graph.params["loss"].tensors if region == "post" else 0)
    zero += sum(per_microbatch_s(cfg, cluster, tensors))  # framework time: FSDP2's own time
    peaks = [region_peak_bytes(p, cfg, cluster)[0] for p in parts]
    peak = max(peaks) + loss_parallel_bytes
    if region == "pre" and cfg.pp > 1 and holds_unit_grads(cfg, cluster) and graph.tied_params:
        # the trace sums a tied head's contribution into the embedding's gradient (Tg counts both);
        # a pipeline's first stage has its own copy of the weight and no head to sum
        peak = max(0.0, peak - graph.tied_params / embedding_tp(graph, cfg, replicated) * cfg.dtype_bytes)
    act = sum(p.saved_bytes for p in parts)
    if region == "post" and keeps_autocast_copies(cluster, cfg):
        # the head's autocast copy of its weight (a tied head's too), saved for its backward
        act += (params + graph.tied_params / embedding_tp(graph, cfg, replicated)) * cfg.dtype_bytes
    return Part(fwd_s=fwd, bwd_s=bwd + zero, recompute_s=0.0, tp_comm_s=tp, cp_comm_s=0.0, zero_comm_s=zero,
                act_bytes=act, params=params,
                fwd_flops=sum(p.fwd_flops for p in parts), bwd_flops=sum(p.bwd_flops for p in parts),
                peak_bytes=peak, head_peak_bytes=peaks[0] if region == "post" else 0.0)
