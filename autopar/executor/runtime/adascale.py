"""AdaScale (Johnson et al., ICML 2020) as FairScale's ``fairscale.optim.AdaScale`` defines it,
written here from that definition and driven by the executor's gradient statistics (grad_norms.py).

A run whose global batch is S times the batch of "one worker" (FairScale's *scale*: the
data-parallel degree times the gradient-accumulation steps, each worker's micro-batch being scale 1)
multiplies its learning rate by the *gain ratio*

    r = (σ² + μ²) / (σ²/S + μ²),      1 ≤ r ≤ S,

where σ² is the variance (the trace of the covariance) of a scale-1 gradient and μ² the squared
norm of the true gradient, and counts its progress in *scale-invariant steps*: each step advances
the counter by r. A schedule tuned at scale 1 for T steps then runs to the counter reaching T.

FairScale's estimates, per step (its ``_final_callback``): σ² and μ² unbiased from the workers'
local and the reduced gradient's squared norms, clamped to σ² ≥ 1e-6 and μ² ≥ 0 (so r stays in
[1, S]), each smoothed by a debiased exponential moving average of smoothing
``max(1 − S/1000, 0)`` (FairScale's default; a smoothing of 0 takes each step's value as it is).
Here σ² and μ² come from the same squared norms as the gradient noise scale (noise_scale.py): with
tr(Σ) per sample and B_1 the scale-1 batch, σ² = tr(Σ) / B_1 and μ² = |G|². Measured on S
identical per-worker gradients both are FairScale's numbers exactly (tests/unit/test_noise_scale.py).

FairScale validates AdaScale for SGD, with or without momentum; for Adam(W) it is not validated
(``autopar run --adascale-force`` is required there: commands/run.py).

Contracts: ``AdaScale.update`` takes one step's ``NormSample`` (identical on every rank) and
returns the gain for that step's optimizer update; ``scaled_lr`` applies it to an optimizer for
exactly one ``step()``. No collectives.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from autopar.executor.runtime.noise_scale import NormSample, estimate

VARIANCE_FLOOR = 1e-6  # FairScale's clamp of σ²


def default_smoothing(scale: float) -> float:
    """FairScale's default EMA smoothing for a scale of ``scale`` workers."""
    return max(1.0 - scale / 1000.0, 0.0)


def gain_ratio(variance: float, grad_sq: float, scale: float) -> float:
    """FairScale's r = (σ² + μ²) / (σ²/S + μ²); in [1, S] for σ² > 0, μ² ≥ 0, S ≥ 1."""
    return (variance + grad_sq) / (variance / scale + grad_sq)


@dataclass(frozen=True, kw_only=True)
class AdaScaleStep:
    """One optimizer step under AdaScale."""

    step: int  # 1-based optimizer step of the run
    gain: float  # r of this step: its learning rate is lr · gain
    progress: float  # scale-invariant steps after this step


@dataclass(frozen=True, kw_only=True)
class AdaScaleReport:
    scale: float
    smoothing: float
    scale_invariant_steps: float
    target: float | None
    gains: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {"scale": self.scale, "smoothing": self.smoothing, "scale_invariant_steps": self.scale_invariant_steps,
                "target": self.target, "gains": list(self.gains)}


class _Ema:
    """FairScale's debiased EMA (``_update_avg`` with ``debias_ewma``)."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing, self.biased, self.unbias = smoothing, 0.0, 0.0

    def update(self, x: float) -> float:
        self.biased = self.smoothing * self.biased + (1.0 - self.smoothing) * x
        self.unbias = self.smoothing * self.unbias + (1.0 - self.smoothing)
        return self.biased / self.unbias


class AdaScale:
    """The gain ratio and the scale-invariant step counter of one run (one per rank, all equal)."""

    def __init__(self, *, scale: float, unit_batch_samples: int, smoothing: float | None = None,
                 target: float | None = None) -> None:
        if not scale > 1:
            raise ValueError(f"AdaScale needs a scale above 1, got {scale}")
        self.scale, self.unit_batch = float(scale), unit_batch_samples
        self.smoothing = default_smoothing(scale) if smoothing is None else smoothing
        self.target = target
        self._var, self._sqr = _Ema(self.smoothing), _Ema(self.smoothing)
        self.gain = 1.0
        self.progress = 0.0
        self._gains: list[float] = []

    def update(self, step: int, sample: NormSample) -> AdaScaleStep:
        """Fold in one step's squared norms; the gain returned is the one this step's update uses."""
        raw = estimate(sample)
        variance = max(raw.trace_sigma / self.unit_batch, VARIANCE_FLOOR)
        grad_sq = max(raw.grad_sq, 0.0)
        if not (math.isfinite(variance) and math.isfinite(grad_sq)):
            raise ValueError(f"AdaScale: non-finite gradient statistics at step {step}")
        self.gain = gain_ratio(self._var.update(variance), self._sqr.update(grad_sq), self.scale)
        self.progress += self.gain
        self._gains.append(self.gain)
        return AdaScaleStep(step=step, gain=self.gain, progress=self.progress)

    def reached(self) -> bool:
        """Whether the scale-invariant counter has reached ``target`` (never without one)."""
        return self.target is not None and self.progress >= self.target - 1e-9

    def report(self) -> AdaScaleReport:
        return AdaScaleReport(scale=self.scale, smoothing=self.smoothing, scale_invariant_steps=self.progress,
                              target=self.target, gains=tuple(self._gains))


@contextmanager
def scaled_lr(optimizer: Any, gain: float) -> Iterator[None]:
    """Every parameter group's learning rate times ``gain`` inside the block, restored after it."""
    groups = optimizer.param_groups
    saved = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = g["lr"] * gain
    try:
        yield
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr
