"""The gradient noise scale of a run: estimators, smoothing and the report (pure arithmetic, no collectives).

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A. A gradient
estimated from a batch of B samples has expectation G (the true gradient) and covariance Σ / B
(Σ: the per-sample covariance), so E|G_B|² = |G|² + tr(Σ) / B. Measured at two batch sizes --
B_small (what one data-parallel rank reduces: its rows of the global batch, or one micro-batch when
the reduction runs per micro-batch) and B_big (the global batch) -- the two unknowns follow:

    |G|²  ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1 / B_small − 1 / B_big)

Each is unbiased where |G_small|² is the mean of the ranks' local squared norms (how
executor/runtime/grad_norms.py measures it), but noisy step to step, and their ratio is not unbiased: so
each is smoothed with an exponential moving average (decay ``EMA_DECAY``, debiased as Adam
debiases its moments: the first steps are the plain mean, not pulled towards 0) and the *simple
noise scale* is the ratio of the smoothed values:

    B_simple = tr(Σ) / |G|²     (in samples: rows of the global batch, sequences for a language model)

Early in a run, or where the noise is small against the signal, the smoothed |G|² can be ≤ 0:
B_simple is then unknown (None), never a negative or infinite number.

Contracts: every function is deterministic arithmetic on Python floats; ``NormSample`` is what the
executor hands over per step (identical on every rank, so every rank's estimator agrees);
``NoiseScaleReport.to_json`` gives only finite numbers or None (the run report is strict JSON).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

EMA_DECAY = 0.95  # per step: a window of about 1 / (1 - 0.95) = 20 steps
HISTORY_LIMIT = 10_000  # steps kept in the report's history (the newest)


@dataclass(frozen=True, kw_only=True)
class NormSample:
    """One optimizer step's squared gradient norms at two batch sizes (whole model, every rank the same).

    ``small_sq``: the mean over the data-parallel ranks (and over the reductions of the step, where
    it reduces per micro-batch) of the squared norm of a gradient of ``b_small_samples`` samples;
    ``big_sq``: the squared norm of the reduced gradient, of ``b_big_samples`` samples."""

    small_sq: float
    big_sq: float
    b_small_samples: int
    b_big_samples: int

    def __post_init__(self) -> None:
        if not 0 < self.b_small_samples < self.b_big_samples:
            raise ValueError(f"need 0 < B_small < B_big, got {self.b_small_samples}, {self.b_big_samples}")


@dataclass(frozen=True, kw_only=True)
class Estimates:
    """Unbiased per-step estimates of |G|² and tr(Σ) (per sample) from one ``NormSample``."""

    grad_sq: float
    trace_sigma: float


def estimate(sample: NormSample) -> Estimates:
    """McCandlish's two unbiased estimators (module docstring) for one step."""
    bs, bb = float(sample.b_small_samples), float(sample.b_big_samples)
    grad_sq = (bb * sample.big_sq - bs * sample.small_sq) / (bb - bs)
    trace = (sample.small_sq - sample.big_sq) / (1.0 / bs - 1.0 / bb)
    return Estimates(grad_sq=grad_sq, trace_sigma=trace)


def b_simple_of(grad_sq: float, trace_sigma: float) -> float | None:
    """tr(Σ) / |G|², or None where it is not a finite non-negative number."""
    if not (math.isfinite(grad_sq) and math.isfinite(trace_sigma)) or grad_sq <= 0 or trace_sigma < 0:
        return None
    return trace_sigma / grad_sq


class DebiasedEma:
    """Exponential moving average ``m ← d·m + (1 − d)·x`` read as ``m / (1 − dᵗ)`` after t updates."""

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay, self._biased, self._weight = decay, 0.0, 0.0

    def update(self, x: float) -> float:
        self._biased = self.decay * self._biased + (1.0 - self.decay) * x
        self._weight = self.decay * self._weight + (1.0 - self.decay)
        return self.value

    @property
    def value(self) -> float:
        return self._biased / self._weight if self._weight > 0 else math.nan


@dataclass(frozen=True, kw_only=True)
class NoiseScalePoint:
    """One step of the history: the step's raw estimates and B_simple of the smoothed ones after it."""

    step: int  # 1-based optimizer step of the run
    grad_sq: float  # raw |G|² of this step alone
    trace_sigma: float  # raw tr(Σ) of this step alone
    b_simple: float | None  # from the EMAs after this step


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass(frozen=True, kw_only=True)
class NoiseScaleReport:
    """The measured gradient noise scale of a run, as the run report and the final log line give it."""

    b_simple: float | None  # tr(Σ) / |G|² of the smoothed estimates after the last step (samples)
    grad_sq: float | None  # smoothed |G|²
    trace_sigma: float | None  # smoothed tr(Σ), per sample
    steps: int  # steps measured
    ema_decay: float
    b_small_samples: int
    b_big_samples: int
    history: tuple[NoiseScalePoint, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {
            "b_simple": _finite(self.b_simple), "steps": self.steps, "grad_sq": _finite(self.grad_sq),
            "trace_sigma": _finite(self.trace_sigma), "ema_decay": self.ema_decay,
            "b_small_samples": self.b_small_samples, "b_big_samples": self.b_big_samples,
            "history": [{"step": p.step, "b_simple": _finite(p.b_simple), "grad_sq": _finite(p.grad_sq),
                         "trace_sigma": _finite(p.trace_sigma)} for p in self.history],
        }

    def summary(self) -> str:
        """The final log line's text (after ``gradient noise scale:``)."""
        value = "unknown (the smoothed |G|² is not positive yet)" if self.b_simple is None else \
            f"B_simple {self.b_simple:,.1f} samples"
        return (f"{value}; |G|² {self.grad_sq:.4g}, tr(Σ) {self.trace_sigma:.4g} per sample, EMA decay "
                f"{self.ema_decay:g} over {self.steps} steps, measured at B_small {self.b_small_samples} and B_big "
                f"{self.b_big_samples}")


class NoiseScaleEstimator:
    """Smooths each step's estimates and keeps the history (one per rank; every rank sees the same samples)."""

    def __init__(self, decay: float = EMA_DECAY) -> None:
        self.decay = decay
        self._grad_sq, self._trace = DebiasedEma(decay), DebiasedEma(decay)
        self._history: list[NoiseScalePoint] = []
        self._steps = 0
        self._batches: tuple[int, int] = (0, 0)

    def update(self, step: int, sample: NormSample) -> NoiseScalePoint:
        """Fold in optimizer step ``step`` (1-based); returns its history entry."""
        raw = estimate(sample)
        self._steps += 1
        self._batches = (sample.b_small_samples, sample.b_big_samples)
        point = NoiseScalePoint(step=step, grad_sq=raw.grad_sq, trace_sigma=raw.trace_sigma,
                                b_simple=b_simple_of(self._grad_sq.update(raw.grad_sq), self._trace.update(raw.trace_sigma)))
        self._history.append(point)
        del self._history[:-HISTORY_LIMIT]
        return point

    @property
    def b_simple(self) -> float | None:
        return b_simple_of(self._grad_sq.value, self._trace.value) if self._steps else None

    def report(self) -> NoiseScaleReport:
        return NoiseScaleReport(
            b_simple=self.b_simple, grad_sq=self._grad_sq.value if self._steps else None,
            trace_sigma=self._trace.value if self._steps else None, steps=self._steps, ema_decay=self.decay,
            b_small_samples=self._batches[0], b_big_samples=self._batches[1], history=tuple(self._history))
