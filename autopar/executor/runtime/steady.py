"""Which measured steps are steady state, and the step time they give (``run`` and ``validate``).

A training loop's first steps are slower than the rest, and not only the first: the allocator
grows its pools, DDP rebuilds its buckets after the first iteration, gloo and NCCL set up their
channels lazily, and on a CPU whose cores the ranks share the scheduler and the caches settle
over a few steps. Four ranks of a small decoder on 2 cores measured 392, 256, 168, 156, 151,
142 ms and then 125-140 ms; the median of the steps after the first alone read 28 % above the
steady figure. So the warm-up is found from the times themselves:

    reference  = median of the last half of the steps
    warm-up    = the steps before the first (from the second on) within WARMUP_TOLERANCE of the
                 reference, at most half of them
    step time  = median of the steps after the warm-up

The rule is deterministic in the step times, which every rank holds alike (the max over ranks),
so every rank agrees on it. ``settling`` says the timed steps still fell (their first half's
median above their second half's by more than the tolerance): more steps would read lower.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

WARMUP_TOLERANCE = 0.10  # a step within 10 % of the late steps' median is steady


@dataclass(frozen=True, kw_only=True)
class SteadyState:
    """The steady part of a run's step times (see the module docstring)."""

    warmup_steps: int  # leading steps left out
    timed_steps: int  # steps the step time is the median of
    step_time_s: float
    settling: bool  # the timed steps were still getting faster

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.timed_steps < 0 or self.step_time_s < 0:
            raise ValueError("warmup_steps, timed_steps and step_time_s must be >= 0")

    def describe(self) -> str:
        """How the step time was taken, in the words of the reports."""
        if self.timed_steps == 0:
            return "no steps"
        first = self.warmup_steps + 1
        last = self.warmup_steps + self.timed_steps
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        return f"median of {steps}, after {self.warmup_steps} warm-up" if self.warmup_steps else f"median of {steps}"


def steady_state(step_times_s: Sequence[float]) -> SteadyState:
    """The steady state of ``step_times_s`` (in step order): the module docstring's rule."""
    times = [float(t) for t in step_times_s]
    n = len(times)
    if n == 0:
        return SteadyState(warmup_steps=0, timed_steps=0, step_time_s=0.0, settling=False)
    if n == 1:
        return SteadyState(warmup_steps=0, timed_steps=1, step_time_s=times[0], settling=False)
    reference = statistics.median(times[n // 2:])
    warmup = n // 2
    for i in range(1, n // 2 + 1):
        if times[i] <= reference * (1 + WARMUP_TOLERANCE):
            warmup = i
            break
    timed = times[warmup:]
    half = len(timed) // 2
    settling = half >= 2 and statistics.median(timed[:half]) > statistics.median(timed[half:]) * (1 + WARMUP_TOLERANCE)
    return SteadyState(warmup_steps=warmup, timed_steps=len(timed), step_time_s=statistics.median(timed),
                       settling=settling)
