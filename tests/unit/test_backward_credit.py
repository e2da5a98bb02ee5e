"""Saved activations freed during a region's backward (graph/live.py's T' and Tg'): the cost model
holds a region's saved tensors whole beside its backward's peak, so the peak it adds is the rise
above what was saved when the backward began -- temporaries less the saved bytes already released."""

from __future__ import annotations

from autopar.graph.live import credited_peaks

SAVED_A, SAVED_B, TEMP_1, TEMP_2, GRAD = 0, 1, 2, 3, 4


def _events() -> list[tuple[int, int, str, str]]:
    """A block saves A (100) and B (40); its backward makes a temporary (30), releases A, makes a
    larger one (120) and a weight gradient (20); then the embedding's backward starts."""
    return [(100, SAVED_A, "fwd", "block"), (40, SAVED_B, "fwd", "block"),
            (30, TEMP_1, "bwd", "block"), (-100, SAVED_A, "bwd", "block"), (120, TEMP_2, "bwd", "block"),
            (20, GRAD, "bwd", "block"), (-30, TEMP_1, "bwd", "block"), (-120, TEMP_2, "bwd", "block"),
            (-40, SAVED_B, "bwd", "pre"), (8, 5, "bwd", "pre")]


def test_the_credit_is_the_saved_bytes_freed_before_the_peak() -> None:
    saved = {SAVED_A, SAVED_B}
    peaks = credited_peaks(_events(), saved, {GRAD}, hold_grads=False)
    temps, grads, credit = peaks[("bwd", "block")]
    # the true peak: B (40) + both temporaries (150) = 190 = saved at backward's start (140) + 50
    assert (temps, grads, credit) == (150, 0, 100) and temps - credit == 50
    # the embedding's backward starts its own credit: B freed there, then its temporary
    assert peaks[("bwd", "pre")] == (8, 0, 40)


def test_unit_gradients_ride_on_the_same_credit() -> None:
    peaks = credited_peaks(_events(), {SAVED_A, SAVED_B}, {GRAD}, hold_grads=True)
    assert peaks[("bwd", "block")] == (150, 20, 100)  # 190 + the gradient = 140 + 70
    assert peaks[("bwd", "pre")][1] == 0  # the block's unit has folded its gradient away


def test_forward_earns_no_credit() -> None:
    events = [(100, SAVED_A, "fwd", "block"), (-100, SAVED_A, "fwd", "block"), (10, TEMP_1, "fwd", "block")]
    assert credited_peaks(events, {SAVED_A}, set(), hold_grads=False) == {}
