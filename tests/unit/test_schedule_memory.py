"""Interleaved 1F1B's activations chunk by chunk (cost.memory.inflight_states): the schedule's states
are torch's own, a rank's peak is the largest weighted state, the planner deals the larger chunks
last (the least memory for any recompute mix), and the split program prices what evaluate prices."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from autopar.cluster import load_cluster
from autopar.cost.memory import chunk_activation_bytes, dealt_sizes, inflight_microbatches, inflight_states, peak_bytes
from autopar.cost.stage import Config, build_terms
from autopar.cost.step import evaluate
from autopar.models.gpt import GPTConfig
from autopar.reference import gpt_graph
from autopar.search.ilp import deal_chunks, rank_block_capacity


def _torch_peak(pp: int, v: int, m: int, rank: int, chunk_bytes: list[float]) -> float:
    """The peak of sum_c n_c chunk_bytes[c] along torch's own op list for ``rank``."""
    from torch.distributed.pipelining.schedules import _ComputationType, _get_1f1b_rank_ops, _get_warmup_ops

    per_round = m // max(1, m // pp)
    warmup = _get_warmup_ops(rank, v, per_round, pp, m, multiply_factor=2)
    steady = v * m - warmup
    ops = _get_1f1b_rank_ops(v, pp, warmup, steady, v * m - steady, rank,
                             lambda s: ((s // per_round) % v) * pp + rank,
                             lambda s: (v - 1 - ((s - warmup) // per_round) % v) * pp + rank)
    counts, best = [0] * v, 0.0
    for op in ops:
        if op is None:
            continue
        counts[op.stage_index // pp] += 1 if op.computation_type == _ComputationType.FORWARD else -1
        best = max(best, sum(n * a for n, a in zip(counts, chunk_bytes)))
    return best


@pytest.mark.parametrize("pp,v", [(2, 2), (3, 3), (4, 2), (4, 6), (8, 5)])
def test_states_are_torchs_interleaved_schedule(pp: int, v: int) -> None:
    rng = random.Random(pp * 10 + v)
    for m in sorted({pp, 2 * pp, 3 * pp, 4 * pp, 8 * pp}):
        for rank in range(pp):
            chunk_bytes = [rng.randint(1, 9) for _ in range(v)]
            states = inflight_states("interleaved-1f1b", pp, rank, m, v)
            assert peak_bytes(states, chunk_bytes) == _torch_peak(pp, v, m, rank, chunk_bytes), (m, rank)
            # the total in flight at the peak is the warm-up plus one, as the average counts it
            assert max(map(sum, states)) == round(v * inflight_microbatches("interleaved-1f1b", pp, rank, m, v))


def test_the_first_chunks_fill_while_the_last_drain() -> None:
    states = inflight_states("interleaved-1f1b", 4, 0, 32, 6)
    assert (7, 4, 4, 4, 4, 4) in states and (8, 8, 4, 4, 3, 0) in states  # warm-up + 1, then drifting
    for state in states:  # every state: a chunk holds at least as many as the next
        assert list(state) == sorted(state, reverse=True)


def test_one_chunk_schedules_have_one_state() -> None:
    assert inflight_states("1f1b", 4, 1, 16) == ((3,),)
    assert inflight_states("gpipe", 4, 1, 16) == ((16,),)
    assert inflight_states("1f1b", 1, 0, 16) == ((1,),)


def test_larger_chunks_last_keep_the_least_whatever_the_modes() -> None:
    rng = random.Random(7)
    act = {"full": 1.0, "selective": 3.0, "none": 8.0}
    for n, v in ((7, 3), (10, 4), (13, 5)):
        assert dealt_sizes(n, v) == sorted(dealt_sizes(n, v)) and sum(dealt_sizes(n, v)) == n
        states = inflight_states("interleaved-1f1b", 4, 0, 16, v)
        arrangements = set(itertools.permutations(dealt_sizes(n, v)))
        for _ in range(5):
            f = rng.randint(0, n)
            s = rng.randint(0, n - f)
            counts = {"full": f, "selective": s, "none": n - f - s}
            dealt = peak_bytes(states, chunk_activation_bytes(dealt_sizes(n, v), act, counts))
            assert all(dealt <= peak_bytes(states, chunk_activation_bytes(a, act, counts)) for a in arrangements)


@pytest.fixture(scope="module")
def tiny():
    return gpt_graph(GPTConfig(num_layers=12, hidden_size=128, num_heads=4, seq_len=64, vocab_size=256))


def _terms(tiny, recompute: str = "none", memory_mib: float = 1e6):  # noqa: ANN001, ANN202
    cluster = dataclasses.replace(load_cluster("a100-80g"), memory_bytes=memory_mib * 2**20, framework_reserve_bytes=0.0,
                                  nccl_bytes_per_group=0.0)
    cfg = Config(dp=1, tp=1, pp=2, cp=1, cp_kind="ring", sequence_parallel=False, zero=0, recompute=recompute,
                 schedule="interleaved-1f1b", virtual_stages=3, micro_batch=2, global_batch=16, seq_len=64,
                 dtype_bytes=2, optimizer="adam")
    return build_terms(tiny, cluster, cfg)


def test_evaluate_weighs_each_chunk_by_its_in_flight_micro_batches(tiny) -> None:
    """Each chunk holds per micro-batch its blocks' activations, the embedding's on the model's first,
    and the output torch pipelining keeps for backward on all but the model's last, less, on all but
    the model's first, its first block's saved input, which is the receive buffer."""
    terms = _terms(tiny)
    assert tiny.block_saves_input and terms.handoff_bytes > 0  # a GPT block's first norm saves its input
    assert terms.received_saved_bytes == terms.handoff_bytes
    split = deal_chunks([7, 5], 3)  # rank 0: 2, 2, 3 blocks; rank 1: 1, 2, 2
    est = evaluate(terms, list(split), 1.0, 1.0, 1.0)
    for r in range(2):
        chunks = [n * terms.block.act_bytes for n in split[r::2]]
        if r == 0:
            chunks[0] += terms.pre.act_bytes
        for k in range(3):  # global chunk k * pp + r of 6
            g = 2 * k + r
            chunks[k] += (terms.handoff_bytes if g < 5 else 0.0) - (terms.received_saved_bytes if g > 0 else 0.0)
        want = peak_bytes(inflight_states("interleaved-1f1b", 2, r, 8, 3), chunks)
        if r == 1:
            want += terms.loss_inflight() * terms.post.act_bytes
        assert est.ranks[r].memory_bytes["activations"] == pytest.approx(want, rel=1e-12)


def test_block_capacity_is_where_evaluate_stops_fitting(tiny) -> None:
    """The cap of each rank: its blocks fit with the other rank at its least (v blocks), one more does not."""
    probe = _terms(tiny)
    one = evaluate(probe, list(deal_chunks([6, 6], 3)), 1.0, 1.0, 1.0)
    memory_mib = one.peak_memory_bytes / 2**20 * 0.9  # binds between 3 and 12 blocks a rank
    terms = _terms(tiny, memory_mib=memory_mib)
    caps = rank_block_capacity(terms)
    for r in range(2):
        for n, fits in ((caps[r], True), (caps[r] + 1, False)):
            if n < 3:
                continue
            counts = [n, 3] if r == 0 else [3, n]
            est = evaluate(terms, list(deal_chunks(counts, 3)), 1.0, 1.0, 1.0)
            assert est.ranks[r].peak_bytes <= terms.capacity_bytes if fits else est.ranks[r].peak_bytes > \
                terms.capacity_bytes, (r, n, caps)


@pytest.mark.parametrize("pp,v,m,rank", [(4, 6, 32, 0), (4, 6, 32, 3), (8, 5, 64, 0), (8, 5, 64, 7), (2, 3, 2, 0)])
def test_the_closed_form_capacity_is_the_general_sum(pp: int, v: int, m: int, rank: int) -> None:
    """``most_blocks`` (the split program's closed form) is the most blocks, dealt over the chunks,
    whose states and activations -- ``peak_bytes`` over every state and chunk, as evaluate sums
    them -- fit the room."""
    from autopar.cost.memory import inflight_table, most_blocks

    table = inflight_table("interleaved-1f1b", pp, rank, m, v)
    for first in (0.0, 5.0):
        def used(n: int, first: float = first) -> float:
            chunks = [k * 3.0 for k in dealt_sizes(n, v)]
            chunks[0] += first
            return 7.0 * n + peak_bytes(table.states, chunks)

        room = 1000.0
        cap = most_blocks(table, per_block_bytes=7.0, act_per_block_bytes=3.0, first_chunk_bytes=first, room_bytes=room)
        assert used(cap) <= room - 1.0 and room < used(cap + 1)  # one byte spare for float rounding


def test_gpipe_capacity_is_where_evaluate_stops_fitting_before_its_gradients(tiny) -> None:
    """GPipe under FSDP2: its peak is the larger of its forwards' end (no gradient yet) and its
    first micro-batch's backward end (every gradient, one micro-batch's activations fewer); the
    capacity is where evaluate's peak stops fitting, on each side of the two moments."""
    base = dataclasses.replace(load_cluster("h100-80g"), framework_reserve_bytes=0.0, nccl_bytes_per_group=0.0,
                               memory_margin_fraction=0.0)
    cfg = Config(dp=2, tp=1, pp=2, cp=1, cp_kind="ring", sequence_parallel=False, zero=1, recompute="none",
                 schedule="gpipe", virtual_stages=1, micro_batch=2, global_batch=16, seq_len=64,
                 dtype_bytes=2, optimizer="adam")
    probe = build_terms(tiny, base, cfg)
    assert probe.loss_free_grads == 1.0
    assert _capacities_match_evaluate(tiny, base, cfg, chunks=1) >= 6


def _capacities_match_evaluate(tiny, base, cfg, chunks: int) -> int:  # noqa: ANN001
    """At 70, 80 and 90 % of the memory a 6 + 6 split needs, each rank's capacity fits and one block
    more does not, by evaluate's peak (the other rank holding the rest of 12 blocks, dealt over
    ``chunks`` chunks a rank); the cases checked."""
    split = (lambda c: list(deal_chunks(c, chunks))) if chunks > 1 else list  # noqa: E731
    whole = evaluate(build_terms(tiny, base, cfg), split([6, 6]), 1.0, 1.0, 1.0).peak_memory_bytes
    checked = 0
    for share in (0.7, 0.8, 0.9):
        terms = build_terms(tiny, dataclasses.replace(base, memory_bytes=whole * share), cfg)
        caps = rank_block_capacity(terms)
        for r in range(2):
            for n, fits in ((caps[r], True), (caps[r] + 1, False)):
                if not chunks <= n <= 12 - chunks:
                    continue
                counts = [n, 12 - n] if r == 0 else [12 - n, n]
                est = evaluate(terms, split(counts), 1.0, 1.0, 1.0)
                assert (est.ranks[r].peak_bytes <= terms.capacity_bytes) == fits, (share, r, n, caps)
                checked += 1
    return checked


def test_held_states_follow_the_schedule_and_keep_the_maximal_moments() -> None:
    """cost/held_states.py: the moments' in-flight counts are the schedule states inflight_states
    gives (the maximal ones); a chunk holds a reduce-scatter input only once its backward has run,
    never the running chunk's; no kept moment is covered by another."""
    from autopar.cost.held_states import held_states

    def covers(a, b) -> bool:  # noqa: ANN001 -- as many in flight on every chunk, at least the same chunks holding
        return all(x >= y for x, y in zip(a[0], b[0])) and (a[1] & b[1]) == b[1]

    for pp, v, m in ((2, 3, 4), (2, 4, 8), (4, 2, 8), (4, 3, 16)):
        for rank in range(pp):
            states = held_states(pp, rank, m, v)
            counts = {n for n, _ in states}
            top = {n for n in counts if not any(o != n and all(x >= y for x, y in zip(o, n)) for o in counts)}
            assert top == set(inflight_states("interleaved-1f1b", pp, rank, m, v))
            assert not any(a != b and covers(a, b) for a in states for b in states)
    # pp 2, v 3, m 4, rank 0: the warm-up (2, 2, 2) and the steady moments holding the most
    # activations meet fewer than v - 1 = 2 held inputs
    states = held_states(2, 0, 4, 3)
    assert ((4, 3, 0), 0b100) in states and ((2, 2, 0), 0b101) in states


def test_zero3_interleaved_capacity_is_where_evaluate_stops_fitting(tiny) -> None:
    """Under ZeRO-3 a chunk holds its reduce-scatter input only once its backward has run: evaluate
    and the split program price the same moments (StageTerms.state_extras), so the capacity is
    where evaluate's peak stops fitting."""
    base = dataclasses.replace(load_cluster("h100-80g"), framework_reserve_bytes=0.0, nccl_bytes_per_group=0.0,
                               memory_margin_fraction=0.0)
    cfg = Config(dp=2, tp=1, pp=2, cp=1, cp_kind="ring", sequence_parallel=False, zero=3, recompute="none",
                 schedule="interleaved-1f1b", virtual_stages=3, micro_batch=2, global_batch=16, seq_len=64,
                 dtype_bytes=2, optimizer="adam")
    probe = build_terms(tiny, base, cfg)
    moments = probe.state_extras(0)
    assert moments is not None and min(moments[1]) < 0.0  # some moment holds fewer than v - 1 inputs
    assert _capacities_match_evaluate(tiny, base, cfg, chunks=3) >= 3


def test_moments_only_lower_the_price_and_change_nothing_where_every_chunk_holds() -> None:
    """Against the schedule states with every other chunk's input held (the price before): the
    moments never price more, and where ``holds_all`` says the steady phase recurs with every input
    held (StageTerms.state_extras then skips the walk), exactly as much for chunks of equal inputs."""
    from autopar.cost.held_states import held_states, holds_all, state_extras

    rng = random.Random(0)
    skipped = 0
    for pp, v, mult in itertools.product((2, 3, 4), (2, 3, 4), (1, 2, 3, 6)):
        m = pp * mult
        for rank in range(pp):
            moments = held_states(pp, rank, m, v)
            old_states = inflight_states("interleaved-1f1b", pp, rank, m, v)
            chunk = [rng.uniform(0.0, 10.0) for _ in range(v)]
            extras = state_extras(moments, [5.0] * v)
            new = max(sum(n * a for n, a in zip(st, chunk)) + x for (st, _), x in zip(moments, extras))
            old = max(sum(n * a for n, a in zip(st, chunk)) for st in old_states)
            assert new <= old + 1e-9
            if holds_all(pp, rank, m, v):
                skipped += 1
                assert new == pytest.approx(old)
    assert skipped > 10
