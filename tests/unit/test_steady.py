"""The steady state of a run's step times (autopar.executor.runtime.steady): the warm-up is found from the
times, not fixed at one step."""

from __future__ import annotations

import statistics

import pytest

from autopar.commands.validate import MAX_AUTO_STEPS, MIN_AUTO_STEPS, auto_steps
from autopar.executor.runtime.steady import steady_state


def test_a_slow_start_over_several_steps_is_left_out() -> None:
    # 4 ranks on 2 cores (issue 18): the first five steps settle, the rest are steady
    times = [0.392, 0.256, 0.168, 0.156, 0.151, 0.124, 0.125, 0.138, 0.124, 0.139, 0.132, 0.138, 0.131, 0.132]
    s = steady_state(times)
    assert s.warmup_steps == 5 and s.timed_steps == len(times) - 5
    assert s.step_time_s == statistics.median(times[5:]) and not s.settling
    assert s.step_time_s < statistics.median(times[1:6]) * 0.9  # six steps less the first read 18 % high
    assert s.describe() == f"median of steps 6-{len(times)}, after 5 warm-up"


def test_a_run_steady_from_its_second_step_keeps_all_but_the_first() -> None:
    times = [0.9, 0.50, 0.52, 0.49, 0.51, 0.50]
    s = steady_state(times)
    assert s.warmup_steps == 1 and s.step_time_s == statistics.median(times[1:])


def test_the_warm_up_is_at_most_half_the_steps_and_a_still_falling_run_says_so() -> None:
    times = [1.0 - 0.05 * i for i in range(12)]  # every step faster than the last
    s = steady_state(times)
    # no step of the first half is within 10 % of the late median (0.575): the cap, half the steps
    assert s.warmup_steps == 6 and s.timed_steps == 6 and s.step_time_s == statistics.median(times[6:])
    assert s.settling  # 0.65 (steps 7-9) against 0.5 (steps 10-12): still falling
    assert not steady_state([1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]).settling


@pytest.mark.parametrize("times", [[], [0.3], [0.3, 0.2], [0.3, 0.2, 0.25]])
def test_short_runs(times: list[float]) -> None:
    s = steady_state(times)
    assert s.warmup_steps + s.timed_steps == len(times)
    assert s.step_time_s == (statistics.median(times[s.warmup_steps:]) if times else 0.0)
    assert s.warmup_steps == (1 if len(times) >= 2 else 0)


def test_noise_within_the_tolerance_is_not_warm_up() -> None:
    times = [0.2, 0.108, 0.1, 0.095, 0.102, 0.1, 0.099, 0.101]
    assert steady_state(times).warmup_steps == 1


def test_the_default_steps_follow_the_predicted_step() -> None:
    assert auto_steps(0.12) == MAX_AUTO_STEPS  # a short CPU step: the most steps
    assert auto_steps(60.0) == MIN_AUTO_STEPS  # a long one: the fewest
    assert MIN_AUTO_STEPS < auto_steps(0.7) < MAX_AUTO_STEPS
    assert auto_steps(0.0) == MAX_AUTO_STEPS
