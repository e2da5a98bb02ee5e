"""ZeRO-3 under interleaved 1F1B: which chunks hold a reduce-scatter input at each moment of a step.

Each chunk of an interleaved rank is its own FSDP2 root (the executor), and where gradients are
reduce-scattered every micro-batch (ZeRO-3) a chunk keeps its last reduce-scatter input -- its root
unit's gradients, in fp32 -- from its backward until its next one; the step's last backward
releases them all (FSDP2's final callback under ``is_last_backward``: torch pipelining's
``perform_reduce_grad``). ``StageTerms.other_chunks_held_bytes`` prices the v - 1 largest beside
the running chunk's, as every moment of a long steady phase holds them; but a moment holds only
those of the chunks whose backward has run in this step: none in the warm-up, where the
activations peak, and with few micro-batches (m = 2 pp: the steady phase is one cycle) not all of
them through the steady phase either (a pp 2, v 4 GPT at ZeRO-3: +2.8..+3.4 % over its rehearsal).

``held_states`` walks a rank's schedule in the order ``cost.memory.inflight_states`` describes
(forward s runs local chunk (s // g) mod v, backward s chunk v - 1 - (s // g) mod v, g the
micro-batches of a round; the warm-up, one forward and one backward per step, then the remaining
backwards) and records, at the start of each backward, the micro-batches in flight per chunk and
the chunks other than the running one whose backward has run: those no other moment holds at least
as many micro-batches of on every chunk and at least those chunks in. The price of a moment is its
activations and the held inputs of those chunks (``state_extras``: relative to the v - 1 largest
that ``other_chunks_held_bytes`` adds, so <= 0).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from autopar.cost.memory import interleaved_warmup, warmup_counts

HeldState = tuple[tuple[int, ...], int]  # (micro-batches in flight per local chunk, bit mask of chunks holding)


def holds_all(pp: int, rank: int, num_microbatches: int, virtual_stages: int) -> bool:
    """Whether every moment that can peak holds the inputs of all v - 1 chunks beside the running
    one: the steady phase runs a whole period of its states (v rounds) after every chunk's first
    backward ((v - 1) rounds), so each of its states recurs with all of them held, and the
    warm-up's and cool-down's moments hold no more activations than one of those."""
    per_round, warmup = interleaved_warmup(pp, rank, num_microbatches, virtual_stages)
    return num_microbatches * virtual_stages - warmup >= (2 * virtual_stages - 1) * per_round


@lru_cache(maxsize=4096)
def held_states(pp: int, rank: int, num_microbatches: int, virtual_stages: int) -> tuple[HeldState, ...]:
    """The maximal moments of ``rank``'s interleaved 1F1B step (module docstring), the most
    micro-batches first."""
    v, total = virtual_stages, num_microbatches * virtual_stages
    per_round, warmup = interleaved_warmup(pp, rank, num_microbatches, v)
    counts = warmup_counts(per_round, warmup, v)
    ran = 0
    masks: dict[tuple[int, ...], set[int]] = {}  # in-flight counts -> the holding chunks met with them
    for backward in range(total):
        if warmup + backward < total:  # the steady phase: a forward before each backward
            counts[((warmup + backward) // per_round) % v] += 1
        chunk = v - 1 - (backward // per_round) % v
        masks.setdefault(tuple(counts), set()).add(ran & ~(1 << chunk))
        counts[chunk] -= 1
        ran |= 1 << chunk
    # the same counts recur with more chunks holding as the step goes on: a mask inside another of
    # the same counts is covered; then across counts, a moment that covers another holds at least
    # as much of both, so it is met first in the order of the most micro-batches and chunks
    seen = [(n, mask) for n, ms in masks.items() for mask in ms if not any(o != mask and o & mask == mask for o in ms)]
    seen.sort(key=lambda st: (-sum(st[0]), -bin(st[1]).count("1")))
    return tuple(st for st, covered in zip(seen, _covered(seen)) if not covered)


def _covered(states: list[HeldState]) -> list[bool]:
    """For each of ``states`` (distinct, the most micro-batches and chunks first), whether an earlier
    one covers it -- holds as many micro-batches on every chunk and a reduce-scatter input on at
    least the same chunks -- all pairs at once."""
    import numpy as np

    counts = np.asarray([n for n, _ in states], dtype=np.int64)
    masks = np.asarray([mask for _, mask in states], dtype=np.int64)
    out = []
    for i in range(len(states)):
        earlier = (counts[:i] >= counts[i]).all(axis=1) & ((masks[:i] & masks[i]) == masks[i])
        out.append(bool(earlier.any()))
    return out


def state_extras(states: Sequence[HeldState], unit_bytes: Sequence[float]) -> tuple[float, ...]:
    """Per moment, the held inputs of its holding chunks (``unit_bytes[c]``: chunk c's) less the
    v - 1 largest of ``unit_bytes`` (what ``StageTerms.other_chunks_held_bytes`` prices): <= 0."""
    most = sum(unit_bytes) - min(unit_bytes)
    return tuple(sum(b for c, b in enumerate(unit_bytes) if mask >> c & 1) - most for _, mask in states)
