"""Whether any stage split can fit memory, decided before a configuration's terms are built.

Building a configuration's terms (``cost.stage.build_terms``) is the search's main cost, and most
configurations of a memory-tight branch end with "no stage split fits" right after it (GPT-3 175B
at 64 GPUs: 2,277 of 5,428 builds). ``upper_capacity`` bounds from above the most blocks each
pipeline rank can hold (``search.ilp.rank_block_capacity`` of the real terms), from what the
branch's one shared terms build already knows (the block's parameters and activations, the
embedding and head) and the ZeRO stage, offload mode and schedule of the configuration. It is the
same memory family (``search.ilp.block_capacities``) with

    sigma_lb  the ZeRO formula's state bytes per parameter (autopar.cost.memory; the executor's
              fp32 ZeRO-1 accumulator and DDP's buckets only add), less what the offload mode
              moves to the host, and less the gradients where a step's only micro-batch without a
              pipeline may meet none at its loss,
    alpha_lb  the block's activations (0 under activation offload; a recompute mix: its most
              frugal mode's),
    I_r       the schedule's in-flight micro-batches,

and transient buffers (ZeRO-3's gathered block, recompute working sets), the tied embedding copy,
a pipeline chunk's handed-on output and FSDP2's padding of a block's parameters left out: each only
adds; a receiving chunk is credited the most its saved received input can be; the interleaved
schedule's gather window (cost.pipeline_window.window_chunks) saves every block's parameters
outside it, at most what the real terms save. Every input is at most the real one, so when these
capacities cannot hold the L blocks, neither can the real ones.
"""

from __future__ import annotations

from autopar.cost.memory import inflight_table, loss_inflight_microbatches, state_bytes_per_param
from autopar.cost.pipeline_window import window_chunks
from autopar.cost.stage import StageTerms
from autopar.plan import Offload
from autopar.search.ilp import block_capacities


def upper_capacity(base: StageTerms, *, zero: int, offload: Offload, schedule: str, pp: int, virtual_stages: int,
                   num_microbatches: int, shard_degree: int, dtype_bytes: int, optimizer: str,
                   capacity_bytes: float, block_act_bytes: float, moment_bytes: float = 4.0,
                   master_bytes: float | None = None, saving_per_param: float = 0.0) -> list[int]:
    """An upper bound on each pipeline rank's block capacity (module docstring); ``base``: terms of
    the same block cost without a pipeline, ``block_act_bytes``: the least activations a block keeps,
    ``moment_bytes`` / ``master_bytes``: the optimizer's precision (cost.memory),
    ``saving_per_param``: model-state bytes per parameter left out besides (the search's bound over
    several schedules: the most a gather window of one of them saves)."""
    state = state_bytes_per_param(zero=zero, shard_degree=shard_degree, dtype_bytes=dtype_bytes, optimizer=optimizer,
                                  moment_bytes=moment_bytes, master_bytes=master_bytes)
    sigma = 0.0 if offload.params else state.total - (state.optimizer if offload.optimizer else 0.0)
    sigma = max(0.0, sigma - saving_per_param)
    inflight_m = num_microbatches
    # the activations may peak before any gradient exists (cost.terms.StageTerms.loss_free_grads): one
    # micro-batch without a pipeline, or GPipe, whose peak is at least that of the end of its first
    # backward -- every gradient beside M - 1 micro-batches' activations (ILP block_capacities)
    if num_microbatches == 1 and (pp == 1 or schedule == "gpipe"):
        sigma = max(0.0, sigma - state.grads)
    elif pp > 1 and schedule == "gpipe":
        inflight_m = num_microbatches - 1
    tables = [inflight_table(schedule, pp, r, inflight_m, virtual_stages) for r in range(pp)]
    other = [base.reserve_bytes] * pp
    if pp > 1 and schedule == "gpipe":  # the embedding's gradients are made after that moment
        other[0] -= state.grads * base.pre.params
    # the gather window's saving at its most: every block's parameters (an MoE block saves its dense part
    # only); ZeRO-3's chunks gathered ahead only add, so they are left out
    k = 0 if offload.states else window_chunks(zero=zero, shard_degree=shard_degree, pp=pp, schedule=schedule,
                                               virtual_stages=virtual_stages)
    g = float(dtype_bytes) * base.block.params if k else 0.0
    # a pipeline's chunk edges (StageTerms.chunk_edges): a chunk's handed-on output only adds; its
    # first block's saved input, the receive buffer, is credited, on every chunk but the model's
    # first, at the most it can be (the hidden state, in fp32 at the most)
    received = base.hidden_bytes * max(1.0, 4.0 / dtype_bytes) if pp > 1 and not offload.activations else 0.0
    edges = [(-received, base.pre.act_bytes + received if r == 0 else 0.0, 0.0) for r in range(pp)]
    return block_capacities(base, pp=pp, virtual_stages=virtual_stages, tables=tables,
                            loss_inflight=loss_inflight_microbatches(schedule, pp, inflight_m), sigma=sigma,
                            block_act_bytes=0.0 if offload.activations else block_act_bytes,
                            other_bytes=other, tied_params=0.0, capacity_bytes=capacity_bytes,
                            window=(k, g, g), edges=edges, block_extra_bytes=0.0)
