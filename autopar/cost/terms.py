"""The types of the linear stage model: ``Config`` (a plan without its stage split), ``Part`` (the
costs of one piece of a stage for one micro-batch) and ``StageTerms`` (every coefficient of the
step time and memory of one configuration). ``cost/stage.py`` builds them (``build_terms``); the
dimensions' own modules (zero, expert, offload, framework, host) read and adjust them, so they
import these types from here and never the builder: no module of ``cost/`` imports in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

from autopar.cost.held_states import held_states, holds_all, state_extras
from autopar.cost.memory import (
    RECOMPUTE_ORDER,
    InflightTable,
    inflight_microbatches,
    inflight_table,
    loss_inflight_microbatches,
    peak_bytes,
    top_blocks,
)
from autopar.cost.pipeline_window import executor_window
from autopar.plan import NO_OFFLOAD, Offload

__all__ = ["Config", "Part", "StageTerms"]


@dataclass(frozen=True, kw_only=True)
class Config:
    """A plan without its stage split: the outer search variables."""

    dp: int
    tp: int
    pp: int
    cp: int
    cp_kind: str
    sequence_parallel: bool
    zero: int
    recompute: str  # none | selective | full | op, or "mixed" (per-stage recompute: per-rank counts, priced by cost.step.evaluate)
    schedule: str
    virtual_stages: int
    micro_batch: int
    global_batch: int
    seq_len: int
    dtype_bytes: int
    optimizer: str
    ep: int = 1  # expert parallelism (autopar.cost.expert)
    moe_imbalance: float = 1.0  # the busiest ep rank's expert load over the mean
    offload: Offload = NO_OFFLOAD  # host-memory offload (autopar.cost.offload)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass(frozen=True, kw_only=True)
class Part:
    """Costs of one piece of a stage for one micro-batch on one rank (seconds, bytes)."""

    fwd_s: float
    bwd_s: float  # backward incl. recompute and exposed per-micro-batch collectives
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    zero_comm_s: float  # exposed ZeRO-2/3 collectives per micro-batch
    act_bytes: float  # activations kept per in-flight micro-batch
    params: float  # parameters on this rank
    fwd_flops: float
    bwd_flops: float
    ep_comm_s: float = 0.0  # expert parallelism: exposed all-to-alls (+ expert grad-sync excess)
    # the most bytes of temporaries while this piece runs (the loss's fp32 copies of the logits and
    # their gradients, gradients of activations: graph/live.py); StageTerms.rank_other_bytes
    peak_bytes: float = 0.0
    # of peak_bytes, the piece's own parameter gradients where FSDP2 holds them (cost.zero.holds_unit_grads):
    # expert parallelism keeps E / ep experts' of them (cost/expert.py)
    peak_grads_bytes: float = 0.0
    # post only: the head's own backward at its peak, the loss's left out -- the phase from the
    # gradient of the model's output on, where FSDP2's root pre-backward prefetches the last block
    # under ZeRO-3 (StageTerms._loss_phase_bytes); 0 on the other pieces
    head_peak_bytes: float = 0.0
    # of a block's act_bytes, what only training under autocast over fp32 parameters keeps (its Linears' 16-bit
    # weight copies, the fp32 activations beyond the trace's: cost.stage.as_trained): a search bound
    # taken from a DDP config subtracts it for the branch's configs trained through FSDP2's policy
    autocast_act_bytes: float = 0.0

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def compute_s(self) -> float:
        """Forward + backward less recompute and every exposed collective: the work itself."""
        return self.time_s - self.recompute_s - self.tp_comm_s - self.cp_comm_s - self.zero_comm_s - self.ep_comm_s


@dataclass(frozen=True, kw_only=True)
class StageTerms:
    """Everything needed to cost any split for one Config."""

    config: Config
    block: Part
    pre: Part  # on the first chunk (embedding)
    post: Part  # on the last chunk (final norm, head, loss)
    p2p_s: float  # one activation transfer between neighbouring stages
    state_bytes_per_param: float
    state_split: dict[str, float]  # params / grads / optimizer bytes per parameter
    grad_sync_s_per_param: float  # end-of-step DP/ZeRO collectives per parameter on the rank
    grad_sync_floor_s: float  # the part that can never overlap (last bucket)
    grad_sync_overlaps: bool  # False: the whole gradient collective runs after backward
    # framework time: DDP's per-bucket latency and rendezvous, once per step, where the sync does not
    # overlap (autopar.cost.zero.ddp_fixed_sync_s); 0 elsewhere
    grad_sync_fixed_s: float = 0.0
    overlap_cost_fraction: float = 0.1  # share of an overlapped collective's time that still costs
    param_gather_s_per_param: float  # ZeRO-1/2 all-gather of updated parameters
    optimizer_s_per_param: float
    # framework time: FSDP2 / DTensor CPU time per step per rank parameter (autopar.cost.framework), in
    # the tail beside the optimizer; 0 on profiles that did not measure it
    framework_s_per_param: float = 0.0
    transient_bytes: float  # ZeRO-3 gathered block, recompute working set
    tied_params: float  # tied embedding copy the last stage also holds (pp > 1)
    reserve_bytes: float
    capacity_bytes: float
    expert: Any = None  # autopar.cost.expert.ExpertCost of one block, None without ep
    # per-stage recompute (config.recompute == "mixed"): the block priced under each mode
    # and that mode's recompute working set, held while a block of that mode re-runs (a rank pays
    # the largest of the modes it uses); ``block`` is then the "none" block and ``transient_bytes``
    # everything else (ZeRO-3's buffers). None for a single-mode config.
    recompute_parts: Mapping[str, Part] | None = None
    recompute_working_bytes: Mapping[str, float] | None = None
    offload: Any = None  # host offload: autopar.cost.offload.OffloadCost, None without offload
    # torch.distributed.pipelining keeps a receive buffer per micro-batch of a step, on every
    # chunk that receives (activations forward, their gradients backward): the bytes of one
    # (0: the software allocates them as it goes, cluster.pipeline_buffers_per_microbatch)
    pipeline_buffer_bytes: float = 0.0
    # The model's output of one micro-batch (the head's logits), which torch pipelining's last stage
    # keeps from the micro-batch's forward through its backward (cost.stage._stage_output_bytes);
    # 0 at pp = 1 and where the software frees it at the loss
    stage_output_bytes: float = 0.0
    # Torch pipelining's chunk boundaries, per micro-batch (``chunk_edges``): the hidden state a chunk
    # hands on, which its stage keeps from the chunk's forward to its backward (``fwd_cache``: the
    # output backward starts from), and of it what the receiving chunk's first block saves, which is
    # the receive buffer itself (priced with the buffers; ModelGraph.block_saves_input). Both 0
    # where the software frees its outputs once sent (Megatron-LM); in use at pp > 1 only.
    handoff_bytes: float = 0.0
    received_saved_bytes: float = 0.0
    hidden_bytes: float = 0.0  # the hidden state itself, whichever of the two hold it (the fit bound's)
    # The rank's rows of the step's batch (global batch / dp samples of the model's inputs, as the
    # model file makes them: ModelGraph.batch_input_bytes), on its device through the step: the
    # executor slices its micro-batches from them there
    batch_bytes: float = 0.0
    # Bytes per micro-batch a stage receives beside the hidden state (ModelGraph.carried_bytes), in
    # ``p2p_s`` and ``pipeline_buffer_bytes`` already; kept for ``autopar explain``. 0 at pp = 1.
    carried_bytes: float = 0.0
    # ZeRO-3 (FSDP2): bytes per root parameter kept gathered (the training dtype), and one block's
    # gathered parameters, prefetched once the gradient of the model's output is made; 0 elsewhere
    zero3_root_params_per_byte: float = 0.0
    zero3_gather_bytes: float = 0.0
    # FSDP2's padding of the embedding's and the head's gathered parameters (ModelGraph
    # RegionParams.padding over the shard degree, in the training dtype), held where the rank holds
    # them gathered (the root unit, from forward to backward at every ZeRO stage); 0 without FSDP2
    pre_padding_bytes: float = 0.0
    post_padding_bytes: float = 0.0
    # and of a block's, held beside its 16-bit parameters where ZeRO-1/2 keep them gathered from
    # forward to the step's end (per block; ZeRO-3 prices it in its gathered blocks): 0 elsewhere
    block_padding_bytes: float = 0.0
    # FSDP2's held reduce-scatter input, in bytes per parameter of the unit whose gradients it holds:
    # fp32 where gradients are reduce-scattered unit by unit inside backward, else 0
    # (cost.zero.held_reduce_input_bytes_per_param). A block's backward holds the previous block's
    # (``held_reduce_bytes``); under a pipeline, a micro-batch's first block to run backward meets the
    # previous micro-batch's last (``pipeline_held_reduce_bytes_per_param``)
    held_reduce_bytes_per_param: float = 0.0
    # FSDP2's root unit (the head and final norm on the last stage) keeps its gradients, unsharded in
    # the training dtype, from the head's backward until the stage's backward ends: through every
    # block's backward of the micro-batch on the last rank (cost.zero.holds_unit_grads); 0 elsewhere
    root_grad_bytes: float = 0.0
    # The share of the rank's gradient memory its backward makes (cost.stage.backward_grads_share):
    # absent until the step's first backward (``loss_free_grads``)
    backward_grads_share: float = 0.0
    # Whether the software reshards the chunks outside torch.distributed.pipelining's gather window
    # (autopar's executor: FSDP2 under the pipelining runtime; not a software with its own gradient
    # buffer, which keeps every 16-bit parameter): ``window`` reads the config's
    gather_window: bool = False

    @cached_property  # read by every evaluate of the search (frozen: cached in the instance's dict)
    def window(self) -> tuple[int, float, float]:
        """The pipelining runtime's gather window as it moves the rank's model-state bytes:
        (K, bytes each block of the K largest local chunks holds, bytes every block does not hold),
        so a rank with chunks of ``sizes`` blocks holds ``window_bytes(sizes)`` more than its states
        per parameter count (cost.pipeline_window.executor_window). ZeRO-1/2: only the three chunks in the
        window hold 16-bit parameters (K 3, g, g); ZeRO-3: two whole chunks gathered ahead of their
        turn (K 2, g, 0); (0, 0, 0) elsewhere. Read from the config, so terms evolved to another
        schedule or v (the search's) price its window. g is a block's 16-bit parameters; an MoE
        block's experts are counted held at ZeRO-1/2 (only the dense part is saved)."""
        if not self.gather_window:
            return 0, 0.0, 0.0
        kept, ahead = executor_window(self.config)
        d = self.config.dtype_bytes
        if kept:
            experts = self.expert.block_params - self.expert.dense_params if self.expert is not None else 0.0
            saved = d * max(0.0, self.block.params - experts) + self.block_padding_bytes
            return kept, saved, saved
        if ahead:
            extra = (self.expert.expert_params - self.expert.block_params + self.expert.dense_params
                     if self.expert is not None else 0.0)
            return ahead, d * (self.block.params + max(0.0, extra)), 0.0
        return 0, 0.0, 0.0

    def window_bytes(self, chunk_sizes: Sequence[int]) -> float:
        """What a rank whose local chunks hold ``chunk_sizes`` blocks holds beyond its model states
        per parameter under the gather window (``window``; negative where it holds less)."""
        k, top, off = self.window
        if not k:
            return 0.0
        return top * top_blocks(chunk_sizes, k) - off * sum(chunk_sizes)

    @property
    def after_sync_s_per_param(self) -> float:
        """Seconds per rank parameter the tail adds after the gradient sync: ZeRO-1's unhidden
        parameter gather, the optimizer and FSDP2's per-tensor time (framework time)."""
        return self.param_gather_s_per_param + self.optimizer_s_per_param + self.framework_s_per_param

    def inflight(self, rank: int) -> float:
        c = self.config
        return inflight_microbatches(c.schedule, c.pp, rank, c.num_microbatches, c.virtual_stages)

    def inflight_table(self, rank: int) -> InflightTable:
        """The per-chunk in-flight counts ``rank``'s schedule peaks in (cost.memory.inflight_table)."""
        c = self.config
        return inflight_table(c.schedule, c.pp, rank, c.num_microbatches, c.virtual_stages)

    def chunk_edges(self, rank: int) -> tuple[float, float, float]:
        """What one micro-batch of ``rank``'s chunks holds beside their blocks' saved activations, as
        (every chunk, its first chunk more, its last chunk more): the embedding's activations on the
        model's first chunk, and under a pipeline each chunk's output but the model's last
        (``handoff_bytes``) less, on each chunk but the model's first, its first block's saved input,
        the receive buffer already priced (``received_saved_bytes``)."""
        c = self.config
        pre = self.pre.act_bytes if rank == 0 else 0.0
        if c.pp == 1:
            return 0.0, pre, 0.0
        handoff, received = self.handoff_bytes, self.received_saved_bytes
        return (handoff - received, pre + (received if rank == 0 else 0.0),
                -handoff if rank == c.pp - 1 else 0.0)

    def chunk_edge_bytes(self, rank: int) -> list[float]:
        """``chunk_edges`` per local chunk of ``rank`` (v of them), in chunk order."""
        every, first, last = self.chunk_edges(rank)
        v = self.config.virtual_stages
        return [every + (first if k == 0 else 0.0) + (last if k == v - 1 else 0.0) for k in range(v)]

    def rank_activation_bytes(self, rank: int, chunk_bytes: Sequence[float]) -> float:
        """The saved activations of ``rank``'s blocks (and the embedding's, on rank 0) at its peak:
        ``chunk_bytes[k]``, what one micro-batch of its k-th local chunk saves, weighed by the
        schedule's in-flight counts per chunk (cost.memory); the head and loss come on top. Under
        ZeRO-3's held reduce-scatter inputs, each moment less what ``state_extras`` says it holds
        less of them than ``rank_other_bytes`` prices."""
        return sum(self.rank_activation_parts(rank, chunk_bytes))

    def rank_activation_parts(self, rank: int, chunk_bytes: Sequence[float]) -> tuple[float, float]:
        """``rank_activation_bytes`` as (the activations of its peak moment, that moment's
        ``state_extras``, <= 0: what the rank's other memory holds less there)."""
        extras = self.state_extras(rank)
        if extras is None:
            return peak_bytes(self.inflight_table(rank).states, chunk_bytes), 0.0
        return max(((sum(n * a for n, a in zip(state, chunk_bytes)), x) for state, x in zip(*extras)),
                   key=sum)

    def loss_inflight(self) -> float:
        """Micro-batches of the last chunk (head, loss) in flight on the last rank (cost.memory)."""
        c = self.config
        return loss_inflight_microbatches(c.schedule, c.pp, c.num_microbatches)

    def mix_working_bytes(self, rank: int, last_rank: int, counts: Mapping[str, int]) -> float:
        """What a per-stage recompute mix (``counts``: blocks of each mode on ``rank``) adds to the
        rank's other memory (``rank_other_bytes(rank, last_rank) +`` this is its other memory).

        A block of mode m re-runs during its own backward, holding m's working set, and by then its
        micro-batch has already run the backward of every block after it -- a rank's blocks take
        full first, then selective, then none (``Plan.block_recompute``), and backward walks them
        in reverse -- so the activations that micro-batch saved in its later modes' blocks are
        released: mode m adds max(0, work_m - sum over later modes m' of n_m' a_m'), a_m' one
        micro-batch's saved bytes of a block of m', and the rank pays the largest over the modes
        it uses. (A none block re-runs nothing: its backward is the phase ``rank_other_bytes``
        already holds.)"""
        if self.recompute_parts is None or self.recompute_working_bytes is None:
            return 0.0
        extra = 0.0
        for i, mode in enumerate(RECOMPUTE_ORDER):
            if counts.get(mode, 0) <= 0:
                continue
            released = sum(counts.get(later, 0) * self.recompute_parts[later].act_bytes for later in RECOMPUTE_ORDER[i + 1:])
            extra = max(extra, self.mode_working_bytes(rank, last_rank, mode) - released)
        return extra

    def mode_working_bytes(self, rank: int, last_rank: int, mode: str) -> float:
        """What using recompute ``mode`` adds to a mixed rank's other memory before any release
        (``mix_working_bytes``): its working set, and its own block's activations in place of a
        none block's beside FSDP2's held reduce-scatter input."""
        assert self.recompute_parts is not None and self.recompute_working_bytes is not None
        return (self.rank_other_bytes(rank, last_rank, self.recompute_working_bytes[mode],
                                      own_act=self.recompute_parts[mode].act_bytes)
                - self.rank_other_bytes(rank, last_rank))

    def root_bytes(self, first: bool, last: bool) -> float:
        """ZeRO-3's root parameters on a rank: FSDP2 keeps the root unit (embedding, head) gathered --
        on a pipeline's last stage with its own copy of a tied head's weight (``tied_params``)."""
        return self.zero3_root_params_per_byte * ((self.pre.params if first else 0.0) +
                                                  (self.post.params + self.tied_params if last else 0.0))

    @property
    def block_grads_bytes(self) -> float:
        """One block's gradients on a rank (``state_split['grads']`` per parameter; an MoE block's
        experts each under their own kind, as ``cost.step.evaluate`` counts them)."""
        grads = self.block.params * self.state_split["grads"]
        if self.expert is not None:
            grads += self.expert.state_delta_bytes("grads", self.state_split)
        return grads

    @property
    def held_reduce_bytes(self) -> float:
        """One block's gradients in the reduce dtype, held while the next block's backward runs."""
        return self.held_reduce_bytes_per_param * self.block.params

    @property
    def pipeline_held_reduce_bytes_per_param(self) -> float:
        """``held_reduce_bytes_per_param`` where a pipeline keeps a micro-batch's last reduce-scatter
        input into the next micro-batch's backward (torch pipelining runs each backward with FSDP2's
        is_last_backward off, so the final callback keeps it until the next reduce), else 0."""
        return self.held_reduce_bytes_per_param if self.config.pp > 1 else 0.0

    @property
    def _loss_phase_bytes(self) -> float:
        """The last rank's loss phase of ``rank_other_bytes``: the loss's and the head's backward
        temporaries and, under ZeRO-3, the first block to run backward, which FSDP2 prefetches
        from the root's pre-backward: a hook on the model's output that fires when its gradient is
        made, so it meets the head's backward (``post.head_peak_bytes``) and not the loss's
        where the loss runs outside the model (a ``loss_fn``), both where the model returns its
        loss (the trace counts such a loss with the head: graph/build.forward_backward)."""
        return self.loss_phase_bytes(self.zero3_gather_bytes)

    def loss_phase_bytes(self, gather_bytes: float) -> float:
        """``_loss_phase_bytes`` with ``gather_bytes`` the first unit to run backward, prefetched
        (a layer chain's last unit: cost/chain.py)."""
        return max(self.post.peak_bytes, self.post.head_peak_bytes + gather_bytes)

    def first_backward_held_bytes(self, first: bool, last: bool, first_unit_params: float | None = None) -> float:
        """The previous micro-batch's last reduce-scatter input that a pipeline rank's first block
        to run backward meets (``pipeline_held_reduce_bytes_per_param``): the root unit's
        gradients where the rank holds edges, else those of the rank's first block (default the
        config's block; a layer chain's stage passes its first unit's parameters), whose
        reduce-scatter runs last. Rehearsed on GPT-3 175B at 64 H100s (dp 2 tp 4 pp 8, ZeRO-3):
        stage 6 holds a block's fp32 gradients (1.69 GiB) at its peak, the last stage the head's
        (0.59 GiB)."""
        root = (self.pre.params if first else 0.0) + (self.post.params + self.tied_params if last else 0.0)
        unit = self.block.params if first_unit_params is None else first_unit_params
        return self.pipeline_held_reduce_bytes_per_param * (root if root > 0 else unit)

    def other_chunks_held_bytes(self, first: bool, last: bool) -> float:
        """The reduce-scatter inputs a rank's other local chunks hold under interleaved 1F1B where
        gradients are reduce-scattered every micro-batch (ZeRO-3): each chunk is its own FSDP2
        root, keeping its last reduce-scatter input (its root unit's gradients where it holds the
        edges, else its first block's) until its next backward, so beside the running chunk's
        (``first_backward_held_bytes``) the v - 1 others hold theirs through every phase -- the
        largest v - 1 of them here. Rehearsed on a 12-layer GPT at dp 2, pp 2, v 6, ZeRO-3: rank 0
        held five blocks' fp32 inputs at its peak."""
        units = self._chunk_held_units(first, last)
        return sum(units) - min(units) if units else 0.0

    def _chunk_held_units(self, first: bool, last: bool) -> list[float]:
        """Each local chunk's held reduce-scatter input (``other_chunks_held_bytes``); [] where none."""
        v, per_param = self.config.virtual_stages, self.pipeline_held_reduce_bytes_per_param
        if v == 1 or not per_param:
            return []
        units = [self.block.params] * v
        if first and self.pre.params > 0:
            units[0] = self.pre.params
        if last and self.post.params + self.tied_params > 0:
            units[-1] = self.post.params + self.tied_params
        return [per_param * u for u in units]

    def state_extras(self, rank: int) -> tuple[tuple[tuple[int, ...], ...], tuple[float, ...]] | None:
        """The moments of ``rank``'s step that ``other_chunks_held_bytes`` overprices, with what each
        holds less (cost/held_states.py: only the chunks whose backward has run hold an input): (the
        in-flight counts per local chunk of each, its bytes <= 0); None where every moment of the
        schedule states holds them all (no interleaving, no per-micro-batch reduce-scatter)."""
        c = self.config
        units = self._chunk_held_units(rank == 0, rank == c.pp - 1)
        if not units or c.schedule != "interleaved-1f1b" or holds_all(c.pp, rank, c.num_microbatches, c.virtual_stages):
            return None
        states = held_states(c.pp, rank, c.num_microbatches, c.virtual_stages)
        return tuple(n for n, _ in states), state_extras(states, units)

    @property
    def loss_free_grads(self) -> float:
        """The share of a rank's gradient memory that does not exist yet where its activations peak:
        ``backward_grads_share`` where the step's first backward on a rank follows every one of its
        forwards -- a step of one micro-batch without a pipeline, and GPipe -- else 0 (a loss meets the
        gradients of the micro-batches before it). Read from the config, so terms evolved to another
        schedule (the search's) price theirs."""
        c = self.config
        first_after_all = (c.pp == 1 and c.num_microbatches == 1) or (c.pp > 1 and c.schedule == "gpipe")
        return self.backward_grads_share if first_after_all else 0.0

    def one_microbatch_peak(self, rank: int, grads_bytes: float, act_bytes: float, end_act_bytes: float,
                            last_rank: int | None = None, first_block: tuple[float, float] = (0.0, 0.0),
                            pre_grads_bytes: float = 0.0) -> tuple[float, float, float]:
        """(other bytes, gradient bytes, activation bytes) at the peak of a rank whose first backward
        of the step follows all its forwards (``loss_free_grads`` > 0: one micro-batch without a
        pipeline, or GPipe). Its backward makes the gradients as it releases the activations: no
        earlier backward left gradients behind, so the rank's whole gradients (``grads_bytes``) and
        whole activations (``act_bytes``) never meet. Four moments, whichever holds most (between the
        last three the bytes change linearly, one block at a time): the loss, with ``loss_free_grads``
        of the gradients not yet made; the first block's backward, with the same gradients and every
        activation; the last block's backward of the first micro-batch (the stage's first block),
        with every gradient but its own and the embedding's (``first_block``: that block's
        (activation bytes, gradient bytes); ``pre_grads_bytes``: the embedding's gradients, on the
        first rank) and what the rank still saves then (``end_act_bytes``: that block's and the
        embedding's of that micro-batch, and every later micro-batch's); and the embedding's
        backward, with every gradient but the embedding's and that block's activations released. A
        block's own gradients, until its backward ends, are its temporaries' (``Part.peak_bytes``).
        ``last_rank``: the pipeline's (default ``rank``: no pipeline)."""
        last = rank if last_rank is None else last_rank
        return self.one_microbatch_moments(self.rank_other_bytes(rank, last),
                                           self.rank_other_bytes(rank, last, loss=False),
                                           grads_bytes, act_bytes, end_act_bytes, first_block, pre_grads_bytes)

    def one_microbatch_moments(self, at_loss_bytes: float, rest_bytes: float, grads_bytes: float,
                               act_bytes: float, end_act_bytes: float, first_block: tuple[float, float] = (0.0, 0.0),
                               pre_grads_bytes: float = 0.0) -> tuple[float, float, float]:
        """``one_microbatch_peak`` from the rank's other bytes at its loss and in its blocks'
        backward (``at_loss_bytes``, ``rest_bytes``), however they are priced (a layer chain's
        stage: cost/chain.py)."""
        share = self.loss_free_grads
        absent = share * grads_bytes
        block_act, block_grads = first_block
        made = grads_bytes - share * pre_grads_bytes
        moments = ((at_loss_bytes, grads_bytes - absent, act_bytes), (rest_bytes, grads_bytes - absent, act_bytes),
                   (rest_bytes, made - share * block_grads, min(act_bytes, end_act_bytes)),
                   (rest_bytes, made, min(act_bytes, end_act_bytes - block_act)))
        return max(moments, key=sum)

    def rank_other_bytes(self, rank: int, last_rank: int, working: float = 0.0, own_act: float | None = None,
                         loss: bool = True) -> float:
        """Memory of pipeline rank ``rank`` beyond its model states, its saved activations and the
        reserve (the estimate's "other" less the reserve), whatever its block count. The step
        peaks in one of three phases, whichever holds most:

        * a block's backward: the config's transients (ZeRO-3's gathered block, its prefetched
          neighbour and the block's unsharded gradients; FSDP2's held reduce-scatter input; a
          single-mode recompute's re-run block) + ``working`` (a recompute mix's largest re-run
          block) + the block's temporaries (gradients of activations: ``Part.peak_bytes``,
          graph/live.py), less, on the last rank, the saved activations of the micro-batch's own
          head and loss (``post.act_bytes``, counted with the activations): its loss backward has
          run and released them before its first block's backward starts; and FSDP2's held
          reduce-scatter input (``held_reduce_bytes``), which a block's backward meets only once
          the block after it has finished its backward and released its activations (``own_act``,
          one micro-batch's saved bytes of a block of the mode in question; default the config's
          block): the larger of the two; under a pipeline, also the first block to run
          backward with the previous micro-batch's last reduce-scatter input whole
          (``first_backward_held_bytes``);
        * the last rank's loss and head backward: their temporaries (the fp32 copies of the
          logits and their gradients) + under ZeRO-3, from the head's backward on, the first
          block's gathered parameters, prefetched for backward (``_loss_phase_bytes``), and under
          a pipeline the previous micro-batch's last reduce-scatter input
          (``first_backward_held_bytes``: a 4-stage GPT at ZeRO-3 held its head's, 0.12 GiB);
        * the first rank's embedding backward (its temporaries);

        (``Part.peak_bytes`` counts a region's own parameter gradients where FSDP2 holds them
        until the unit's post-backward, and the last rank's block and embedding phases add the
        root unit's, ``root_grad_bytes``)

        and in every phase ZeRO-3's root parameters (embedding, head: FSDP2 keeps the root unit
        gathered from forward to backward), on the last rank of a pipeline the outputs of the
        micro-batches whose loss and backward are pending (``stage_output_bytes`` each, as many as
        ``loss_inflight``: one under 1F1B, every one under GPipe, whose last stage keeps each
        micro-batch's logits from its forward to its backward), and the pipeline's receive buffers
        (``pipeline_buffer_bytes`` per micro-batch and receiving chunk: every chunk but the first
        receives activations, every one but the last their gradients), and the rank's rows of the
        step's batch (``batch_bytes``). Non-decreasing in
        ``working``: a mix pays the largest working set of the modes it uses. ``loss`` False: the
        loss phase left out (``one_microbatch_peak``)."""
        c = self.config
        first, last = rank == 0, rank == last_rank
        own = self.block.act_bytes if own_act is None else own_act
        root_grads = self.root_grad_bytes if last else 0.0
        block = self.transient_bytes + self.block.peak_bytes - (self.post.act_bytes if last else 0.0) + root_grads
        phases = [block + working + max(0.0, self.held_reduce_bytes - own)]
        if self.pipeline_held_reduce_bytes_per_param:  # a micro-batch's first block: nothing released yet
            phases.append(block + self.first_backward_held_bytes(first, last))
        if last and loss:
            # under a pipeline the previous micro-batch's last reduce-scatter input (the root's) is
            # held through this one's loss too: its next reduce is this micro-batch's first block's
            phases.append(self._loss_phase_bytes + self.first_backward_held_bytes(first, last))
        if first:
            phases.append(self.pre.peak_bytes + root_grads)
        other = (self.root_bytes(first, last) + max(phases) + self.other_chunks_held_bytes(first, last) + self.batch_bytes
                 + (self.pre_padding_bytes if first else 0.0) + (self.post_padding_bytes if last else 0.0)
                 + (self.stage_output_bytes * self.loss_inflight() if last else 0.0))
        if c.pp > 1 and self.pipeline_buffer_bytes > 0:
            receiving = 2 * c.virtual_stages - first - last
            other += c.num_microbatches * receiving * self.pipeline_buffer_bytes
        return other
