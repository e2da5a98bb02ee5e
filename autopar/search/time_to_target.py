"""Planning for time to target: which GPU count and global batch reach a target loss soonest.

The planner's default objective is throughput: the fastest step at a given global batch. But past
the critical batch size a larger batch buys throughput and no progress: it takes nearly as many
steps to reach the same loss. McCandlish et al. (2018, "An Empirical Model of Large-Batch
Training", eq. 2.11 and §2.3) fit the steps S and the samples E needed to reach a given loss with

    (S / S_min - 1) (E / E_min - 1) = 1,   E = B S,

whose solution at batch B (samples per step) is

    S(B) = S_min (1 + B_noise / B),

with B_noise the gradient noise scale (the critical batch ~ B_noise = E_min / S_min) in samples.
Anchored at one measured point -- S0 steps to the target at batch B0 --

    S_min = S0 / (1 + B_noise / B0).

The time to target of a point (N GPUs, batch B) is S(B) times the step time of the best plan the
search finds there, t(N, B), and its cost is N S(B) t(N, B) / 3600 GPU-hours. Minimising the time is
maximising Pollux's *goodput* (Qiao et al., OSDI '21, §3.1): throughput B / t times the statistical
efficiency (B_noise + B0) / (B_noise + B), whose product is S0 B0 / (S(B) t).

The best point has the least time to target; a tie (equal to 1e-9 relative) goes to fewer
GPU-hours, then fewer GPUs, then the smaller batch. Steps are real numbers here (the model is a fit;
rounding to whole steps changes no choice that matters).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from autopar.errors import AutoparError
from autopar.plan import Objective, Plan
from autopar.report import table

if TYPE_CHECKING:
    from autopar.search.sweep import SweepPoint

TIE_REL = 1e-9  # times this close are a tie (broken by GPU-hours, GPUs, batch)
REPORT_KEY = "gradient_noise_scale"  # the run report's section (autopar run --report)


@dataclass(frozen=True, kw_only=True)
class StepModel:
    """McCandlish et al.'s empirical model of the steps to a target loss against the batch.

    ``steps(B) = min_steps * (1 + noise_scale_samples / B)``: ``min_steps`` (S_min) is the limit at
    an infinite batch, ``noise_scale_samples`` (B_noise) the gradient noise scale in samples."""

    noise_scale_samples: float
    min_steps: float

    def __post_init__(self) -> None:
        for name in ("noise_scale_samples", "min_steps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise AutoparError(f"StepModel.{name} must be a positive finite number, got {value!r}")

    @classmethod
    def anchored(cls, *, noise_scale_samples: float, target_steps: float, at_batch_samples: float) -> "StepModel":
        """The model through (B0, S0) = (``at_batch_samples``, ``target_steps``):
        S_min = S0 / (1 + B_noise / B0)."""
        return cls(noise_scale_samples=noise_scale_samples,
                   min_steps=target_steps / (1.0 + noise_scale_samples / at_batch_samples))

    @property
    def min_samples(self) -> float:
        """E_min = S_min B_noise: the samples needed at a vanishing batch (the limit of B S(B))."""
        return self.min_steps * self.noise_scale_samples

    def steps(self, batch_samples: float) -> float:
        """S(B) = S_min (1 + B_noise / B): the optimizer steps to the target at ``batch_samples``."""
        if batch_samples <= 0:
            raise AutoparError(f"the global batch must be positive, got {batch_samples}")
        return self.min_steps * (1.0 + self.noise_scale_samples / batch_samples)

    def samples(self, batch_samples: float) -> float:
        """E(B) = B S(B) = E_min (1 + B / B_noise): the samples processed to the target."""
        return batch_samples * self.steps(batch_samples)


def step_model_of(objective: Objective) -> StepModel:
    """The StepModel of a time-to-target plan objective."""
    if objective.kind != "time-to-target":
        raise AutoparError(f"objective {objective.kind} has no step model; it needs kind time-to-target")
    return StepModel.anchored(noise_scale_samples=float(objective.noise_scale),
                              target_steps=float(objective.target_steps), at_batch_samples=float(objective.at_batch))


@dataclass(frozen=True, kw_only=True)
class TimeToTargetRow:
    """One (GPUs, global batch) point: its best plan's step time and the time to target it gives,
    or, where nothing fits, the reason (``error``) and no times."""

    gpus: int
    global_batch_samples: int | None  # None: a point with no plan at the default batch
    plan_label: str  # the best plan's layout (``sweep.plan_text``), or the reason nothing fits
    step_time_s: float | None = None
    steps: float | None = None
    time_to_target_s: float | None = None
    error: str | None = None

    @property
    def gpu_hours(self) -> float | None:
        """GPUs x time to target, in hours."""
        return None if self.time_to_target_s is None else self.gpus * self.time_to_target_s / 3600.0


def time_to_target_row(*, gpus: int, global_batch_samples: int, step_time_s: float, model: StepModel,
                       plan_label: str = "") -> TimeToTargetRow:
    """The row of one point with a plan: S(B) steps of ``step_time_s`` each."""
    steps = model.steps(global_batch_samples)
    return TimeToTargetRow(gpus=gpus, global_batch_samples=global_batch_samples, plan_label=plan_label,
                           step_time_s=step_time_s, steps=steps, time_to_target_s=steps * step_time_s)


def rows_of_sweep(points: Sequence["SweepPoint"], model: StepModel) -> list[TimeToTargetRow]:
    """One row per sweep point, in the sweep's order (GPUs outermost, then batch)."""
    from autopar.search.sweep import plan_text

    rows = []
    for p in points:
        if p.found is None:
            reason = (p.error or "").split(":", 1)[0]
            rows.append(TimeToTargetRow(gpus=p.gpus, global_batch_samples=p.global_batch, plan_label=reason,
                                        error=p.error or reason))
            continue
        rows.append(time_to_target_row(gpus=p.gpus, global_batch_samples=p.found.space.global_batch,
                                       step_time_s=p.found.result.top[0].estimate.step_time_s, model=model,
                                       plan_label=plan_text(p.found)))
    return rows


def best_index(rows: Sequence[TimeToTargetRow]) -> int | None:
    """The index of the row with the least time to target (ties within ``TIE_REL``: fewer
    GPU-hours, then fewer GPUs, then the smaller batch); None when no row has a plan."""
    timed = [i for i, r in enumerate(rows) if r.time_to_target_s is not None]
    if not timed:
        return None
    least = min(rows[i].time_to_target_s for i in timed)
    tied = [i for i in timed if rows[i].time_to_target_s <= least * (1.0 + TIE_REL)]
    return min(tied, key=lambda i: (rows[i].gpu_hours, rows[i].gpus, rows[i].global_batch_samples))


def _hours(h: float) -> str:
    if h >= 1000:
        return f"{h:,.0f}"
    return f"{h:,.1f}" if h >= 10 else f"{h:,.2f}" if h >= 0.01 else f"{h:.2g}"


def time_to_target_report(rows: Sequence[TimeToTargetRow], model: StepModel) -> str:
    """The table: one row per point, the best marked ``*`` in the first column; then a line with the
    step model's parameters."""
    best = best_index(rows)
    out = []
    for i, r in enumerate(rows):
        mark = "*" if i == best else ""
        if r.time_to_target_s is None:
            out.append((mark, r.gpus, r.global_batch_samples or "-", r.plan_label, "-", "-", "-", "-"))
            continue
        out.append((mark, r.gpus, r.global_batch_samples, r.plan_label, f"{r.step_time_s:,.3f}",
                    f"{r.steps:,.0f}", _hours(r.time_to_target_s / 3600.0), _hours(r.gpu_hours)))
    text = table(["", "GPUs", "global batch", "best plan", "step s", "steps", "to target h", "GPU-hours"],
                 out, align="lrrlrrrr")
    return (f"{text}\n\nsteps S(B) = S_min (1 + B_noise / B): B_noise {model.noise_scale_samples:,.4g} samples, "
            f"S_min {model.min_steps:,.0f} steps (McCandlish et al. 2018); * least time to target "
            f"(ties: fewer GPU-hours)")


def best_line(row: TimeToTargetRow) -> str:
    """``least time to target: 256 GPUs at global batch 2,048, 41.2 h, 10,547.2 GPU-hours``."""
    return (f"least time to target: {row.gpus:,} GPUs at global batch {row.global_batch_samples:,}, "
            f"{_hours(row.time_to_target_s / 3600.0)} h, {_hours(row.gpu_hours)} GPU-hours")


def prediction_of(row: TimeToTargetRow, *, best: bool) -> dict[str, Any]:
    """What a point's plan records under ``prediction.time_to_target``."""
    return {"steps": row.steps, "time_to_target_s": row.time_to_target_s, "gpu_hours": row.gpu_hours,
            "best_of_sweep": best}


def with_objective(plan: Plan, objective: Objective, row: TimeToTargetRow, *, best: bool) -> Plan:
    """``plan`` recording the objective it was chosen for and, under ``prediction.time_to_target``,
    its point's steps, time to target and GPU-hours."""
    prediction = {**(plan.prediction or {}), "time_to_target": prediction_of(row, best=best)}
    return dataclasses.replace(plan, objective=objective, prediction=prediction)


def noise_scale_from_report(path: str | Path) -> float:
    """B_simple (samples) from a run report (``autopar run --report``):
    ``{"gradient_noise_scale": {"b_simple": ..., "steps": ..., "history": [...]}}``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AutoparError(f"--noise-scale-from {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AutoparError(f"--noise-scale-from {p}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise AutoparError(f"--noise-scale-from {p} is not JSON ({exc}); give the report of 'autopar run --report'") \
            from None
    section = data.get(REPORT_KEY) if isinstance(data, dict) else None
    if not isinstance(section, dict) or "b_simple" not in section:
        raise AutoparError(f"--noise-scale-from {p} has no {REPORT_KEY}.b_simple: a run at data-parallel degree 2 "
                           "or more reports it ('autopar run --report'); or give --noise-scale B")
    value = section["b_simple"]
    if value is None:
        raise AutoparError(f"--noise-scale-from {p}: {REPORT_KEY}.b_simple is null, the run did not pin it down "
                           "(too few steps, or the noise small against the gradient); run longer or give --noise-scale B")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise AutoparError(f"--noise-scale-from {p}: {REPORT_KEY}.b_simple is {value!r}, not a positive noise scale "
                           "(too few steps measured?); give --noise-scale B")
    return float(value)


def objective_of(*, kind: str, noise_scale: float | None, noise_scale_from: str | None,
                 target_steps: float | None, at_batch: int | None, seq_lens: Sequence[int | None]) -> Objective | None:
    """The objective ``autopar plan``'s options ask for (None: throughput, the default), checked
    before any work: each bad value is a one-line AutoparError naming its option."""
    given = [name for name, v in (("--noise-scale", noise_scale), ("--noise-scale-from", noise_scale_from),
                                  ("--target-steps", target_steps), ("--at-batch", at_batch)) if v is not None]
    if kind != "time-to-target":
        if given:
            raise AutoparError(f"{given[0]} is for --objective time-to-target (the objective is {kind})")
        return None
    if noise_scale is not None and noise_scale_from is not None:
        raise AutoparError("give one of --noise-scale and --noise-scale-from, not both")
    if noise_scale is None and noise_scale_from is None:
        raise AutoparError("--objective time-to-target needs the gradient noise scale: --noise-scale B (samples) or "
                           "--noise-scale-from RUN.json (the report of 'autopar run --report')")
    if noise_scale is not None and not (math.isfinite(noise_scale) and noise_scale > 0):
        raise AutoparError(f"--noise-scale must be a positive number of samples, got {noise_scale:g}")
    if target_steps is None or at_batch is None:
        missing = "--target-steps" if target_steps is None else "--at-batch"
        raise AutoparError(f"--objective time-to-target needs {missing}: the steps to the target (--target-steps S0) "
                           "at one global batch (--at-batch B0)")
    if not (math.isfinite(target_steps) and target_steps > 0):
        raise AutoparError(f"--target-steps must be a positive number of steps, got {target_steps:g}")
    if at_batch <= 0:
        raise AutoparError(f"--at-batch must be a positive number of samples, got {at_batch}")
    if len(seq_lens) > 1:
        raise AutoparError("--objective time-to-target compares GPU counts and batches at one sequence length "
                           "(the noise scale is measured at one): give one --seq-len")
    if noise_scale_from is not None:
        noise_scale = noise_scale_from_report(noise_scale_from)
    return Objective(kind="time-to-target", noise_scale=noise_scale, target_steps=target_steps, at_batch=at_batch,
                     noise_scale_from=noise_scale_from)

