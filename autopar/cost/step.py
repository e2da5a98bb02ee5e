"""One training step of a whole plan: pipeline schedule, bubble, tails, memory per rank.

With t_r the forward+backward time of one micro-batch on pipeline rank r (all its chunks), M
micro-batches and v chunks per rank (v = 1 for GPipe and 1F1B):

    step = (M - 1/v) * max_r t_r + sum_r t_r / v + max_r tail_r
    tail_r = max(floor, grad_sync(params_r) - backward_r) + c * grad_sync(params_r)
             + params_r * (gather + optimizer)

(where the gradient sync does not overlap backward: tail_r = grad_sync(params_r) + DDP's per-bucket
latencies + params_r * (gather + optimizer)).

For equal stages this is M t + (p - 1) t / v: the work of M micro-batches plus Megatron's
interleaved bubble (p - 1)/v; for v = 1 it is 1F1B's (M - 1) max t + sum t. The tail is the
end-of-step gradient collective that backward could not hide (with ZeRO-1's parameter all-gather
when the software overlaps it, autopar.cost.zero), ZeRO-1's all-gather when it does not, and the
optimizer update. Memory per rank = model states + in-flight activations + transient buffers +
the largest rise above the saved activations among the rank's pieces (the loss's, a block's
backward: graph/live.py) + the framework reserve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from autopar.cost.memory import chunk_activation_bytes
from autopar.cost.stage import StageTerms


@dataclass(frozen=True, kw_only=True)
class RankCost:
    """One pipeline rank (every dp/cp/tp rank of it costs the same)."""

    rank: int
    num_blocks: int
    time_s: float  # one micro-batch, forward + backward, all chunks
    backward_s: float
    tail_s: float
    params: float
    memory_bytes: dict[str, float]

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory_bytes.values())


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """The cost model's prediction for one plan (the contract of ``estimate --json`` is built on it)."""

    step_time_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_bytes: float
    capacity_bytes: float
    memory_bytes: dict[str, float]  # breakdown of the peak rank
    time_breakdown_s: dict[str, float]
    ranks: tuple[RankCost, ...] = field(default=())
    bubble_fraction: float = 0.0
    reserve_bytes: float = 0.0  # of "other": what no tensor holds (context, NCCL, ...; cost/stage.py reserve_bytes)
    # expert parallelism's figures (autopar.cost.expert.moe_summary), None without ep
    moe: dict[str, Any] | None = None

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.capacity_bytes - self.peak_memory_bytes


def chunk_rank(chunk: int, pp: int) -> int:
    """Interleaved schedules place chunk c on rank c mod pp."""
    return chunk % pp


def evaluate(terms: StageTerms, chunk_blocks: Sequence[int], model_flops_per_step: float,
             tokens_per_step: float, peak_flops: float,
             recompute_blocks: Sequence[Sequence[int]] | None = None) -> Estimate:
    """Cost ``terms`` with ``chunk_blocks[c]`` blocks in chunk c (len = pp * v).

    ``recompute_blocks`` (per-stage recompute; required by, and only for, the terms of a "mixed" config): per
    pipeline rank the (none, selective, full) block counts, summing to the rank's blocks. A rank's
    block terms are then the sum over modes of count x that mode's block, and its transient memory
    the largest working set among the modes it uses; every cost term depends on the counts only."""
    cfg = terms.config
    mix = _mode_counts(terms, chunk_blocks, recompute_blocks)
    pp, v, m = cfg.pp, cfg.virtual_stages, cfg.num_microbatches
    last = len(chunk_blocks) - 1
    b, pre, post = terms.block, terms.pre, terms.post
    time = [0.0] * pp
    bwd = [0.0] * pp
    params = [0.0] * pp
    blocks = [0] * pp
    for c, n in enumerate(chunk_blocks):
        r = chunk_rank(c, pp)
        blocks[r] += n
        if mix is None:
            time[r] += n * b.time_s
            bwd[r] += n * b.bwd_s
        params[r] += n * b.params
        if pp > 1:
            time[r] += terms.p2p_s * ((c < last) + (c > 0))
        if c == 0:
            time[r] += pre.time_s
            bwd[r] += pre.bwd_s
            params[r] += pre.params
        if c == last:
            time[r] += post.time_s
            bwd[r] += post.bwd_s
            params[r] += post.params + terms.tied_params
    act_by_mode = {mode: part.act_bytes for mode, part in (terms.recompute_parts or {}).items()}
    working = [0.0] * pp  # per-stage recompute: a mixed rank's recompute working set
    if mix is not None:
        for r, counts in enumerate(mix):
            for mode, k in counts.items():
                time[r] += k * terms.recompute_parts[mode].time_s
                bwd[r] += k * terms.recompute_parts[mode].bwd_s
            working[r] = terms.mix_working_bytes(r, chunk_rank(last, pp), counts)
    ranks = []
    for r in range(pp):
        sync = params[r] * terms.grad_sync_s_per_param
        if terms.grad_sync_overlaps:
            # Hidden behind the last backward, but contention costs a share of all of it (an upper
            # estimate of the hidden part that keeps the tail convex, so the ILP stays exact).
            tail = max(terms.grad_sync_floor_s if sync > 0 else 0.0, sync - bwd[r])
            tail += terms.overlap_cost_fraction * sync
        else:
            tail = sync + (terms.grad_sync_fixed_s if sync > 0 else 0.0)
        tail += params[r] * terms.after_sync_s_per_param
        # what one micro-batch of each of the rank's chunks holds, in local chunk order: its blocks'
        # saved activations and its edges (the embedding's in the first chunk; a pipeline's
        # handed-on output less the received input: StageTerms.chunk_edges)
        sizes = list(chunk_blocks[r::pp])
        chunks = [n * b.act_bytes for n in sizes] if mix is None else chunk_activation_bytes(sizes, act_by_mode, mix[r])
        chunks = [a + e for a, e in zip(chunks, terms.chunk_edge_bytes(r))]
        activations, held_less = terms.rank_activation_parts(r, chunks)  # ZeRO-3 interleaved: StageTerms.state_extras
        if r == chunk_rank(last, pp):
            activations += terms.loss_inflight() * post.act_bytes
        split = terms.state_split
        memory = {
            "params": params[r] * split["params"],
            "grads": params[r] * split["grads"],
            "optimizer": params[r] * split["optimizer"],
        }
        if terms.expert is not None:  # the same total, each expert byte under its own kind
            for kind in ("params", "grads", "optimizer"):
                memory[kind] += blocks[r] * terms.expert.state_delta_bytes(kind, split)
        # FSDP2's padding of each block's gathered parameters (ZeRO-1/2), and interleaved 1F1B's
        # gathered parameters of the runtime's window (StageTerms.window)
        memory["params"] += blocks[r] * terms.block_padding_bytes + terms.window_bytes(sizes)
        if terms.loss_free_grads > 0 and mix is None:  # the first backward follows every forward (one
            # micro-batch without a pipeline, GPipe): at the end of the first micro-batch's backward its
            # first block's and embedding's activations remain, and every later micro-batch's
            later = activations * (m - 1) / m
            other, memory["grads"], activations = terms.one_microbatch_peak(
                r, memory["grads"], activations, later + b.act_bytes + (pre.act_bytes if r == 0 else 0.0),
                last_rank=chunk_rank(last, pp), first_block=(b.act_bytes, terms.block_grads_bytes),
                pre_grads_bytes=pre.params * split["grads"] if r == 0 else 0.0)
        else:
            other = terms.rank_other_bytes(r, chunk_rank(last, pp)) + working[r] + held_less
        memory = {**memory, "activations": activations, "other": other + terms.reserve_bytes}
        ranks.append(RankCost(rank=r, num_blocks=blocks[r], time_s=time[r], backward_s=bwd[r], tail_s=tail,
                              params=params[r], memory_bytes=memory))
    slowest = max(time)
    steady = (m - 1 / v) * slowest
    fill_drain = sum(time) / v
    tail = max(rk.tail_s for rk in ranks)
    step = steady + fill_drain + tail
    peak_rank = max(ranks, key=lambda rk: rk.peak_bytes)
    n_blocks_total = sum(chunk_blocks)
    if mix is None:
        def blocks_sum(name: str) -> float:
            return n_blocks_total * getattr(b, name)
    else:  # per-stage recompute: each mode's blocks at that mode's terms
        def blocks_sum(name: str) -> float:
            return sum(k * getattr(terms.recompute_parts[mode], name) for counts in mix for mode, k in counts.items())
    per_mb = {
        "compute": blocks_sum("compute_s")
        + pre.time_s + post.time_s - pre.tp_comm_s - post.tp_comm_s - pre.zero_comm_s - post.zero_comm_s,
        "recompute": blocks_sum("recompute_s"),
        "tp_comm": blocks_sum("tp_comm_s") + pre.tp_comm_s + post.tp_comm_s,
        "cp_comm": blocks_sum("cp_comm_s"),
        "zero_comm": blocks_sum("zero_comm_s") + pre.zero_comm_s + post.zero_comm_s,
        "pp_comm": terms.p2p_s * 2 * last if pp > 1 else 0.0,
    }
    if cfg.ep > 1:  # the experts' all-to-alls (a key only where ep is used: old outputs unchanged)
        per_mb["ep_comm"] = blocks_sum("ep_comm_s")
    # Each part's share of the step: M micro-batches of work spread over pp ranks; the rest of the
    # pipeline time is bubble (fill/drain and imbalance between stages). The parts sum to the step.
    busy = sum(time)
    breakdown = {k: val * m / pp for k, val in per_mb.items()}
    breakdown["bubble"] = steady + fill_drain - m * busy / pp
    optimizer = max(rk.params * terms.optimizer_s_per_param for rk in ranks)
    breakdown["optimizer"] = optimizer
    breakdown["dp_tail"] = tail - optimizer
    return Estimate(
        step_time_s=step,
        tokens_per_s=tokens_per_step / step,
        mfu=model_flops_per_step / (step * cfg.num_gpus * peak_flops),
        peak_memory_bytes=peak_rank.peak_bytes,
        capacity_bytes=terms.capacity_bytes,
        memory_bytes=dict(peak_rank.memory_bytes),
        time_breakdown_s=breakdown,
        ranks=tuple(ranks),
        bubble_fraction=max(0.0, breakdown["bubble"]) / step if step else 0.0,
        reserve_bytes=terms.reserve_bytes,
        moe=_moe_summary(terms, n_blocks_total),
    )


def _mode_counts(terms: StageTerms, chunk_blocks: Sequence[int],
                 recompute_blocks: Sequence[Sequence[int]] | None) -> list[dict[str, int]] | None:
    """Per-stage recompute: the per-rank mode counts as {mode: count}, checked against the split; None for a
    single-mode config."""
    from autopar.plan import RECOMPUTE_MODES

    if terms.recompute_parts is None:
        if recompute_blocks is not None:
            raise ValueError("recompute_blocks needs the terms of a 'mixed' recompute config")
        return None
    pp = terms.config.pp
    if recompute_blocks is None or len(recompute_blocks) != pp:
        raise ValueError(f"a 'mixed' recompute config needs (none, selective, full) counts for each of {pp} ranks")
    mix = []
    for r, counts in enumerate(recompute_blocks):
        if len(counts) != len(RECOMPUTE_MODES) or min(counts) < 0 or sum(counts) != sum(chunk_blocks[r::pp]):
            raise ValueError(f"rank {r}: recompute counts {tuple(counts)} do not split its {sum(chunk_blocks[r::pp])} blocks")
        mix.append(dict(zip(RECOMPUTE_MODES, counts)))
    return mix


def _moe_summary(terms: StageTerms, num_blocks: int) -> dict[str, Any] | None:
    if terms.expert is None:
        return None
    from autopar.cost.expert import moe_summary

    return moe_summary(terms.expert, terms.config, num_blocks)
