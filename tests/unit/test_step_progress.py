"""The step lines of `autopar run` and `autopar validate` say how long the remaining steps take."""

from __future__ import annotations

from autopar.executor.runtime.train import _time_left


def test_time_left_is_the_remaining_steps_at_the_median_steady_step() -> None:
    assert _time_left([1.3], 0) == ""  # the last step: nothing left to say
    assert _time_left([0.2], 3) == "  <1 s left"
    assert _time_left([5.0], 2) == "  ~10 s left"  # only the warm-up step so far: it is the estimate
    assert _time_left([9.0, 2.0, 4.0, 3.0], 10) == "  ~30 s left"  # the warm-up left out once others exist
    assert _time_left([9.0, 60.0], 3) == "  ~3.0 min left"
