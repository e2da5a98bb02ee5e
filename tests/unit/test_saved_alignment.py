"""Saved tensors of a trace paired with those of its varied traces when a variant saves a tensor more or
fewer (graph/scaling.py ``_fit_saved``): HF StarCoder2 builds its attention mask only where the
sequence reaches its window, so its half-sequence trace saves one tensor fewer; every saved tensor of
its block then took the total's exponent (1.25), and the per-layer attention bias, priced as a
sequence-sharded tensor under SP, came out at half its bytes (its 64-H100 plan rehearsed -2.7 %,
+0.1 % paired)."""

from __future__ import annotations

import math

from autopar.graph.records import SavedRecord, Trace
from autopar.graph.scaling import _fit_saved


def _trace(*records: tuple[float, bool]) -> Trace:
    return Trace(saved=[SavedRecord(region="block", nbytes=n, attention_bias=bias) for n, bias in records])


def test_a_tensor_the_half_sequence_does_not_save_leaves_the_others_paired() -> None:
    s = 4096.0
    base = _trace((8 * s, False), (2 * s * s, True), (8 * s, False), (32 * s, False))
    b2 = _trace((16 * s, False), (4 * s * s, True), (16 * s, False), (64 * s, False))
    half = _trace((4 * s, False), (4 * s, False), (16 * s, False))  # no mask at half the sequence
    fit = _fit_saved("block", base, b2, half, None)
    assert [q.exps.s for q in fit] == [1.0, 2.0, 1.0, 1.0]
    assert [q.exps.b for q in fit] == [1.0] * 4


def test_an_unpaired_tensor_that_is_no_attention_bias_takes_the_total() -> None:
    base = _trace((100.0, False), (60.0, False), (100.0, False))
    half = _trace((50.0, False), (50.0, False))
    fit = _fit_saved("block", base, None, half, None)
    assert fit[0].exps.s == 1.0 and fit[2].exps.s == 1.0
    # the region's total goes 260 -> 100 bytes: log2(2.6) = 1.38, a quarter-step exponent of 1.5
    assert fit[1].exps.s == round(math.log2(260 / 100) * 4) / 4 == 1.5


def test_a_loop_saving_one_state_per_step_keeps_the_total_exponent() -> None:
    base = _trace(*[(10.0, False)] * 40)  # 40 steps
    half = _trace(*[(10.0, False)] * 20)  # 20 steps: too many to pair
    fit = _fit_saved("block", base, None, half, None)
    assert {q.exps.s for q in fit} == {1.0}  # the total halves: every tensor takes s^1


def test_equal_counts_pair_by_position() -> None:
    base = _trace((100.0, False), (400.0, False))
    half = _trace((50.0, False), (100.0, False))
    assert [q.exps.s for q in _fit_saved("block", base, None, half, None)] == [1.0, 2.0]
