"""Memory per rank: model states under ZeRO 0-3 and in-flight activations under each schedule.

Model states per parameter (ZeRO, SC20 Table 1), with ``d`` the training dtype's bytes and ``K`` the
optimizer's fp32 bytes (Adam: fp32 master copy + two moments = 12 with 16-bit training, 8 in fp32
where the parameter is its own master), sharded over the ``N = dp * cp`` ranks that hold the
same weights:

    ZeRO-0   d + d + K            ZeRO-2   d + (d + K) / N
    ZeRO-1   d + d + K / N        ZeRO-3   (d + d + K) / N

K is the software's: Apex's DistributedFusedAdam keeps bf16 moments and no master (K = 4) or the
fp32 master's low 16 bits (K = 10) where NeMo asks it to (``Cluster.optimizer_moment_bytes``,
``master_weight_bytes``).

In-flight micro-batches held by pipeline rank r (0-based) of p with M micro-batches:
GPipe M; 1F1B min(M, p - r); interleaved with v chunks per rank, counted in chunks of n_r / v
blocks: min(M v, 2 (p - r - 1) + (v - 1) p + 1) (Megatron's warm-up; for r = 0 this is
Korthikanti's p v (1 + (p - 1)/(p v))).

Interleaved 1F1B, chunk by chunk (``inflight_states``). A rank of an interleaved pipeline does not
keep the same number of micro-batches in flight on each of its v chunks, nor the same numbers over
the step. torch's ``ScheduleInterleaved1F1B`` (and Megatron's interleaved schedule, the same order)
runs a warm-up of W_r = (v - 1) g + 2 (p - 1 - r) forwards (at most M v), g the micro-batches of one
round (M / max(1, M // p): p when p divides M), then one forward and one backward per step, then
the remaining backwards; forward s runs local chunk (s // g) mod v, backward s (counted from the
end of the warm-up) chunk v - 1 - (s // g) mod v. So the first chunks fill while the last ones
drain: at p 4, v 6, M 32 rank 0 passes through 8, 8, 4, 4, 3, 0 micro-batches on its six chunks
(27 in all: the warm-up plus one), not 27 / 6 on each. A rank's activations take the most, over
the states it passes through after each forward, of sum_c n_c A_c (A_c: what one micro-batch of
chunk c saves -- its blocks, and the embedding on the first rank's first chunk). The average above
times all of a rank's blocks is that only where every chunk saves the same: with a rank's blocks
dealt 4, 4, 3, 3, 3, 3 (the larger first, as the planner dealt them) the chunks that hold the most
save the most (Llama-3 70B on 1,024 H100s rehearsed 4 % above the average's price on its first
stage; the planner now deals the larger chunks last, ``dealt_sizes``), and with a recompute
mix whose none blocks (the largest) sit in the last chunk, which holds the fewest, the average
overpriced GPT-3 175B's later stages by 5-9 %. Only maximal states matter (bytes are non-negative).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Mapping, Sequence

from autopar.errors import PlanError

# A rank's blocks in execution order take their recompute modes in this order (plan.Plan.block_recompute).
RECOMPUTE_ORDER = ("full", "selective", "none")

MOMENTS = {"adam": 2, "adamw": 2, "sgd": 1}  # state tensors per parameter (Adam: m and v; SGD: momentum)


def optimizer_state_bytes_per_param(optimizer: str, dtype_bytes: int, *, moment_bytes: float = 4.0,
                                    master_bytes: float | None = None) -> float:
    """Bytes per parameter the optimizer keeps beyond the training-dtype parameter: its moments at
    ``moment_bytes`` each and the master copy (``master_bytes``; None: fp32 beside a 16-bit
    parameter, none where the parameter is fp32). The defaults are torch's and Megatron's (fp32
    state); ``Cluster.optimizer_moment_bytes`` / ``master_weight_bytes`` describe other software."""
    moments = MOMENTS.get(optimizer)
    if moments is None:
        raise PlanError(f"unknown optimizer {optimizer!r}; use adam, adamw or sgd")
    master = (4.0 if dtype_bytes < 4 else 0.0) if master_bytes is None else master_bytes
    return master + moments * moment_bytes


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes per parameter on one rank, split by what they are."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@lru_cache(maxsize=4096)  # a pure function of six scalars, asked tens of thousands of times per search
def state_bytes_per_param(*, zero: int, shard_degree: int, dtype_bytes: int, optimizer: str,
                          moment_bytes: float = 4.0, master_bytes: float | None = None) -> StateBytes:
    """Model-state bytes per parameter on one rank (see the module docstring); ``moment_bytes`` and
    ``master_bytes``: the optimizer's precision (``optimizer_state_bytes_per_param``)."""
    if zero not in (0, 1, 2, 3):
        raise PlanError(f"zero must be 0, 1, 2 or 3; got {zero}")
    n = max(1, shard_degree)
    d = float(dtype_bytes)
    k = optimizer_state_bytes_per_param(optimizer, dtype_bytes, moment_bytes=moment_bytes, master_bytes=master_bytes)
    if zero == 0:
        return StateBytes(params=d, grads=d, optimizer=k)
    if zero == 1:
        return StateBytes(params=d, grads=d, optimizer=k / n)
    if zero == 2:
        return StateBytes(params=d, grads=d / n, optimizer=k / n)
    return StateBytes(params=d / n, grads=d / n, optimizer=k / n)


def loss_inflight_microbatches(schedule: str, pp: int, num_microbatches: int) -> float:
    """Micro-batches whose last chunk's activations (the head and the loss) the last pipeline rank
    holds at its peak: GPipe runs every forward first (M); 1F1B and interleaved 1F1B run the last
    chunk's forward of a micro-batch only in the steady state, right before its backward (1) --
    the interleaved warm-up fills the rank's earlier chunks, (v - 1) pp micro-batch chunks, before
    the last chunk's first forward (Megatron's schedule, as torch.distributed.pipelining's)."""
    if pp == 1:
        return 1.0
    return float(num_microbatches) if schedule == "gpipe" else 1.0


def inflight_microbatches(schedule: str, pp: int, rank: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches (of a whole rank's blocks) whose activations rank ``rank`` holds at its peak;
    non-increasing in ``rank`` for every schedule (the last rank holds the fewest: the bounds of
    cost.host read it there)."""
    m = num_microbatches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    if schedule == "interleaved-1f1b":
        v = virtual_stages
        chunks = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
        return chunks / v
    raise PlanError(f"unknown pipeline schedule {schedule!r}")


@lru_cache(maxsize=8192)
def inflight_states(schedule: str, pp: int, rank: int, num_microbatches: int,
                    virtual_stages: int = 1) -> tuple[tuple[int, ...], ...]:
    """The maximal per-chunk in-flight counts rank ``rank`` passes through (module docstring):
    each a tuple of v counts, local chunk order; one state for a one-chunk schedule."""
    v, m = virtual_stages, num_microbatches
    if schedule != "interleaved-1f1b" or v == 1 or pp == 1:
        n = inflight_microbatches(schedule, pp, rank, m, 1)
        return ((int(n),) + (0,) * (v - 1),) if v > 1 else ((int(n),),)
    per_round, warmup = interleaved_warmup(pp, rank, m, v)
    counts = warmup_counts(per_round, warmup, v)  # the warm-up only adds: its last state holds every earlier one
    if warmup == m * v:
        return (tuple(counts),)
    # Past the warm-up every forward is followed by a backward, so every state after a forward holds
    # warm-up + 1 micro-batches: none holds another (they differ only by where those are), and each
    # holds the warm-up's states. The cool-down's backwards only release. Forwards and backwards
    # walk the chunks with a period of v rounds, each chunk gaining and losing a round's worth in
    # it: the states repeat after v rounds.
    seen: dict[tuple[int, ...], None] = {}
    for step in range(min(m * v - warmup, v * per_round)):
        counts[((warmup + step) // per_round) % v] += 1
        seen[tuple(counts)] = None
        counts[v - 1 - (step // per_round) % v] -= 1
    return tuple(seen)


def interleaved_warmup(pp: int, rank: int, num_microbatches: int, virtual_stages: int) -> tuple[int, int]:
    """(g, W_r) of ``rank``'s interleaved 1F1B step (module docstring): the micro-batches of one round
    and the forwards of its warm-up."""
    m, v = num_microbatches, virtual_stages
    per_round = m // max(1, m // pp)
    return per_round, min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)


def warmup_counts(per_round: int, warmup: int, virtual_stages: int) -> list[int]:
    """Per local chunk, the micro-batches in flight once the warm-up's ``warmup`` forwards have run
    (rounds of ``per_round`` forwards walk the chunks in order: ``interleaved_warmup``)."""
    counts = [0] * virtual_stages
    for forward in range(warmup):
        counts[(forward // per_round) % virtual_stages] += 1
    return counts


def peak_bytes(states: Sequence[Sequence[int]], chunk_bytes: Sequence[float]) -> float:
    """The most activation bytes over ``states``: max over states of sum_c n_c chunk_bytes[c]."""
    return max(sum(n * a for n, a in zip(state, chunk_bytes)) for state in states)


def dealt_sizes(num_blocks: int, virtual_stages: int) -> list[int]:
    """A rank's blocks dealt over its v chunks as evenly as possible, the larger chunks last
    (``search.ilp.deal_chunks``). In every state of the schedule a chunk holds at least as many
    micro-batches as the next (forwards fill the chunks in order, backwards drain them last to
    first), so with the larger chunks last every block position sits in a chunk holding no more
    than under any other arrangement: the least activations, whatever modes the positions take."""
    base, extra = divmod(num_blocks, virtual_stages)
    return [base + (1 if k >= virtual_stages - extra else 0) for k in range(virtual_stages)]


def top_blocks(sizes: Sequence[int], chunks: int) -> int:
    """Blocks in the ``chunks`` largest of a rank's local chunks (``sizes``; all of them where
    ``chunks`` >= v): what a gather window prices (cost.pipeline_window.executor_window) -- the largest, so the
    price never holds less than the schedule does at any moment."""
    return sum(sorted(sizes)[len(sizes) - min(max(chunks, 0), len(sizes)):])


@dataclass(frozen=True, kw_only=True)
class InflightTable:
    """A rank's schedule states (``inflight_states``) with the sums the search's capacities read:
    ``total``, the micro-batches every state holds in all (past the warm-up each forward is
    followed by a backward, so every state holds the same; one state: its own), ``held[s][k]``,
    state s's micro-batches on chunks k..v-1 (k = 0..v), and ``most[k]``, the most any state
    holds there."""

    states: tuple[tuple[int, ...], ...]
    total: int
    held: tuple[tuple[int, ...], ...]
    most: tuple[int, ...]

    @cached_property
    def frontier(self) -> tuple[int, ...]:
        """The states that can hold the most of act on chunks k..v-1 plus first on chunk 0 for
        some k and some act, first >= 0: for each k, those no other state beats on both (its first
        chunk, and chunks k..v-1). Only the first rank (the embedding) asks: made on first use."""
        frontier: set[int] = set()
        groups: dict[int, list[int]] = {}
        for i, state in enumerate(self.states):
            groups.setdefault(state[0], []).append(i)
        by_first = [groups[f] for f in sorted(groups, reverse=True)]
        for k in range(len(self.most)):  # first chunk from most to least: kept if it holds more on k..v-1
            best = -1
            for group in by_first:
                i = max(group, key=lambda i: self.held[i][k])
                if self.held[i][k] > best:
                    frontier.add(i)
                    best = self.held[i][k]
        return tuple(sorted(frontier))

    def held_last(self, act_per_block_bytes: float, first_chunk_bytes: float, every_chunk_bytes: float = 0.0,
                  last_chunk_bytes: float = 0.0) -> list[float]:
        """For k = 0..v: the most any state holds of ``act_per_block_bytes`` per micro-batch on its
        chunks k..v-1 plus ``first_chunk_bytes`` per micro-batch on its first chunk,
        ``last_chunk_bytes`` on its last and ``every_chunk_bytes`` on each (a pipeline's chunk
        edges: cost.terms.StageTerms.chunk_edges; every state holds ``total`` micro-batches in all)."""
        every = every_chunk_bytes * self.total
        if last_chunk_bytes:
            return [every + max(act_per_block_bytes * h[k] + first_chunk_bytes * st[0] + last_chunk_bytes * st[-1]
                                for h, st in zip(self.held, self.states)) for k in range(len(self.most))]
        if first_chunk_bytes == 0:
            return [every + act_per_block_bytes * n for n in self.most]
        return [every + max(act_per_block_bytes * self.held[i][k] + first_chunk_bytes * self.states[i][0]
                            for i in self.frontier) for k in range(len(self.most))]


@lru_cache(maxsize=8192)
def inflight_table(schedule: str, pp: int, rank: int, num_microbatches: int, virtual_stages: int = 1) -> InflightTable:
    """``inflight_states`` with its sums (``InflightTable``), once per schedule and rank."""
    states = inflight_states(schedule, pp, rank, num_microbatches, virtual_stages)
    if len(states) == 1 and len(states[0]) == 1:  # one chunk, one state (no interleaving)
        (n,), = states
        return InflightTable(states=states, total=n, held=((n, 0),), most=(n, 0))
    totals = {sum(s) for s in states}
    if len(totals) != 1:
        raise ValueError("schedule states of different totals")
    v = len(states[0])
    held = tuple(_suffix_sums(s) for s in states)
    return InflightTable(states=states, total=totals.pop(), held=held,
                         most=tuple(max(h[k] for h in held) for k in range(v + 1)))


def _suffix_sums(state: tuple[int, ...]) -> tuple[int, ...]:
    """state[k:] summed, for k = 0..v."""
    out, running = [0], 0
    for n in reversed(state):
        running += n
        out.append(running)
    return tuple(reversed(out))


def most_blocks(table: InflightTable, *, per_block_bytes: float, act_per_block_bytes: float,
                first_chunk_bytes: float, room_bytes: float, limit: int = 10**9, top_chunks: int = 0,
                top_chunk_bytes: float = 0.0, edges: tuple[float, float, float] | None = None,
                moments: tuple[Sequence[Sequence[int]], Sequence[float]] | None = None) -> int:
    """The most blocks N a rank can hold in ``room_bytes``: N x ``per_block_bytes`` (model states)
    plus ``top_chunk_bytes`` for each block of the ``top_chunks`` largest chunks (``top_blocks``: a
    gather window's parameters) plus ``peak_bytes`` of N blocks of ``act_per_block_bytes`` dealt
    over the chunks (``dealt_sizes``), ``first_chunk_bytes`` more on the first (``edges``: (every,
    first, last) chunk's bytes per micro-batch, StageTerms.chunk_edges, instead); -1 where not even
    none fit, ``limit`` where any number does. In closed form: with N = b v + e the dealt chunks
    hold b blocks each and one more on the last e, so state s holds b total + held[s][v - e]
    blocks' activations and the K = min(top_chunks, v) largest chunks K b + min(K, e) blocks,
    linear in b for each e:
    b <= (room - per_block e - top min(K, e) - the most held on the last e chunks)
         / (per_block v + top K + act total);
    one byte is kept spare for float rounding, so a count found here fits the sums evaluate makes.

    ``moments``: (states, bytes each holds beyond its activations) in place of ``table``'s states
    (ZeRO-3 interleaved: StageTerms.state_extras; states of differing totals), each state's own
    bound taken: b <= min over states of the same quotient with that state's total and bytes."""
    v, best = len(table.states[0]), -1
    k = min(max(top_chunks, 0), v)
    every, first, last = edges if edges is not None else (0.0, first_chunk_bytes, 0.0)
    if moments is not None:
        return _most_blocks_by_state(moments, v, k, per_block_bytes, act_per_block_bytes, (every, first, last),
                                     room_bytes, limit, top_chunk_bytes)
    held_last = table.held_last(act_per_block_bytes, first, every, last)
    slope = per_block_bytes * v + top_chunk_bytes * k + act_per_block_bytes * table.total
    for e in range(v):
        spare = room_bytes - 1.0 - per_block_bytes * e - top_chunk_bytes * min(k, e) - held_last[v - e]
        if spare < 0:
            continue
        bound = min(limit, math.floor(spare / slope)) if slope > 0 else limit
        best = max(best, min(limit, bound * v + e))
    return best


def _most_blocks_by_state(moments: tuple[Sequence[Sequence[int]], Sequence[float]], v: int, k: int,
                          per_block_bytes: float, act_per_block_bytes: float, edges: tuple[float, float, float],
                          room_bytes: float, limit: int, top_chunk_bytes: float) -> int:
    """``most_blocks`` over explicit moments (its ``moments`` argument)."""
    every, first, last = edges
    best = -1
    for e in range(v):
        bound = limit
        for state, extra in zip(*moments):
            total = sum(state)
            held = sum(state[v - e:])  # the last e chunks hold one block more
            spare = (room_bytes - 1.0 - per_block_bytes * e - top_chunk_bytes * min(k, e) - act_per_block_bytes * held
                     - every * total - first * state[0] - last * state[-1] - extra)
            if spare < 0:
                bound = -1
                break
            slope = per_block_bytes * v + top_chunk_bytes * k + act_per_block_bytes * total
            if slope > 0:
                bound = min(bound, math.floor(spare / slope))
        if bound >= 0:
            best = max(best, min(limit, bound * v + e))
    return best


def chunk_activation_bytes(sizes: Sequence[int], act_bytes: Mapping[str, float], counts: Mapping[str, int]) -> list[float]:
    """Bytes one micro-batch of each chunk saves: a rank's blocks in execution order (its chunks in
    order, each chunk's blocks ascending) take its ``counts`` of each mode, full first, then
    selective, then none (``plan.Plan.block_recompute``); ``act_bytes``: one block's per mode."""
    modes = [m for m in RECOMPUTE_ORDER for _ in range(counts.get(m, 0))]
    if len(modes) != sum(sizes):
        raise ValueError(f"mode counts {counts} do not cover the rank's {sum(sizes)} blocks")
    out, at = [], 0
    for n in sizes:
        out.append(sum(act_bytes[m] for m in modes[at:at + n]))
        at += n
    return out
