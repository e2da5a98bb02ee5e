"""The report of ``autopar run`` (rank 0): what ran, what was measured, the plan's prediction and
the errors in %, as the JSON written by ``--report`` and the table printed after training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.executor.runtime.run_options import RunOptions
from autopar.executor.runtime.steady import steady_state


def _error_pct(measured: float, predicted: Any) -> float | None:
    if not isinstance(predicted, (int, float)) or isinstance(predicted, bool) or predicted == 0:
        return None
    return 100.0 * (measured - predicted) / predicted


def read_prediction(plan_path: str) -> dict[str, Any]:
    """The plan file's ``prediction`` mapping (load_plan ignores it by contract, so read it here)."""
    import yaml

    from autopar.yamlload import load_yaml

    try:
        data = load_yaml(Path(plan_path).read_text(encoding="utf-8"), plan_path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AutoparError, RecursionError):
        return {}
    pred = data.get("prediction") if isinstance(data, dict) else None
    return dict(pred) if isinstance(pred, dict) else {}


def build_report(plan, model_path: str, result, world: int, options: RunOptions,  # noqa: ANN001
                 warnings: list[str]) -> dict[str, Any]:
    """The JSON report (rank 0): what ran, what was measured, the prediction and the errors in %."""
    import math

    pred = dict(plan.prediction or {}) or read_prediction(options.plan_path)
    # ``prediction`` is ignored on load by contract, so anything may be in it: keep finite numbers only.
    pred = {k: float(v) for k, v in pred.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    measured = {
        "step_time_s": result.step_time_s,
        "tokens_per_s": result.tokens_per_s,
        "peak_memory_bytes": max(result.peak_memory_bytes),
    }
    return {
        "plan": str(options.plan_path),
        "model": model_path,
        "world_size": world,
        "steps": options.steps,
        "seed": options.seed,
        "lr": options.lr,
        "parallel": {k: getattr(plan.parallel, k) for k in ("dp", "tp", "pp", "cp", "zero", "recompute", "pp_schedule")},
        "losses": list(result.losses),
        "step_times_s": list(result.step_times_s),
        "measured": measured,
        "peak_memory_bytes_per_rank": list(result.peak_memory_bytes),
        "memory_measure": result.memory_measure,
        "predicted": {k: pred[k] for k in measured if k in pred},
        "error_pct": {k: _error_pct(v, pred.get(k)) for k, v in measured.items() if k in pred},
        "notes": list(result.notes),
        "warnings": warnings,
        # docs/batch-size.md: null where the plan does not measure it (dp 1, cp > 1, ep > 1)
        "gradient_noise_scale": result.noise_scale.to_json() if result.noise_scale is not None else None,
        "adascale": result.adascale.to_json() if result.adascale is not None else None,
    }


def format_comparison(report: dict[str, Any]) -> str:
    m, p, e = report["measured"], report["predicted"], report["error_pct"]
    units = {"step_time_s": ("step time", lambda v: f"{v:.4f} s"),
             "tokens_per_s": ("tokens/s", lambda v: f"{v:,.0f}"),
             "peak_memory_bytes": ("peak memory", lambda v: f"{v / 2**20:,.1f} MiB")}
    lines = ["measured vs predicted:", f"  {'':12s} {'measured':>16s} {'predicted':>16s} {'error':>9s}"]
    for key, (label, fmt) in units.items():
        pv = fmt(p[key]) if key in p else "-"
        ev = f"{e[key]:+.1f}%" if e.get(key) is not None else "-"
        lines.append(f"  {label:12s} {fmt(m[key]):>16s} {pv:>16s} {ev:>9s}")
    rule = steady_state(report.get("step_times_s", [])).describe()
    lines.append(f"  (memory: {report['memory_measure']}, max over ranks; step time: {rule})")
    return "\n".join(lines)
