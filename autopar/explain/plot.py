"""Pictures: ``explain --plot`` (memory per pipeline stage, time breakdown) and a sweep's scaling
curve (``plan --gpus a,b,c --plot``), or its time to target (``plan --objective time-to-target
--plot``). matplotlib is an optional extra (``pip install autopar[plot]``);
without it ``require_matplotlib`` raises a one-line AutoparError saying how to get it.

Every number drawn comes from the cost model's Estimate (the same one ``estimate`` prints), and the
file is written atomically (a temporary file renamed into place), so nothing half-drawn is left.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from autopar.errors import AutoparError

if TYPE_CHECKING:  # pragma: no cover
    from autopar.explain.explanation import Explanation
    from autopar.search.sweep import SweepPoint
    from autopar.search.time_to_target import TimeToTargetRow

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "other")
INSTALL_HINT = "plotting needs matplotlib: pip install 'autopar[plot]' (or pip install matplotlib)"


def require_matplotlib() -> Any:
    """The pyplot module on the non-interactive Agg backend, or a one-line AutoparError."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        raise AutoparError(INSTALL_HINT) from None
    return pyplot


def _check_target(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if p.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise AutoparError(f"--plot {p}: the file must end in .png, .svg or .pdf")
    return p


def _save(fig: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise AutoparError(f"cannot write {path}: {exc.strerror}") from None


def plot_explanation(ex: "Explanation", path: str | os.PathLike[str]) -> Path:
    """Left: memory per GPU of each pipeline stage as stacked bars (params, grads, optimizer,
    activations, other) against the GPU's capacity. Right: where the step time goes."""
    target = _check_target(path)
    plt = require_matplotlib()
    est = ex.estimate
    size, unit = (2**30, "GiB") if est.capacity_bytes >= 4 * 2**30 else (2**20, "MiB")
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    ranks = list(est.ranks)
    xs = list(range(len(ranks)))
    bottom = [0.0] * len(ranks)
    for key in MEMORY_KEYS:
        values = [r.memory_bytes.get(key, 0.0) / size for r in ranks]
        ax_mem.bar(xs, values, bottom=bottom, label=key, width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_mem.axhline(est.capacity_bytes / size, color="black", linestyle="--", linewidth=1)
    ax_mem.text(len(ranks) - 0.5, est.capacity_bytes / size, f" capacity {est.capacity_bytes / size:,.0f} {unit}",
                va="bottom", ha="right", fontsize=8)
    ax_mem.set_xticks(xs, [f"{r.rank}\n{r.num_blocks} bl" for r in ranks], fontsize=8 if len(ranks) <= 16 else 6)
    ax_mem.set_xlabel("pipeline stage (blocks)")
    ax_mem.set_ylabel(f"memory per GPU ({unit})")
    ax_mem.set_ylim(0, max(max(bottom, default=0.0), est.capacity_bytes / size) * 1.12)
    ax_mem.legend(fontsize=8, ncol=3, loc="upper left")
    ax_mem.set_title("memory per GPU by pipeline stage", fontsize=10)

    parts = [(k.replace("_", " "), v) for k, v in est.time_breakdown_s.items() if v > 0]
    parts.sort(key=lambda kv: kv[1])
    ax_time.barh([k for k, _ in parts], [v for _, v in parts], color="tab:gray")
    for i, (_, v) in enumerate(parts):
        ax_time.text(v, i, f" {v / est.step_time_s * 100:.1f} %", va="center", fontsize=8)
    ax_time.set_xlabel("seconds per step")
    ax_time.set_xlim(0, max((v for _, v in parts), default=1.0) * 1.3)
    ax_time.set_title(f"step {est.step_time_s:,.3g} s, MFU {est.mfu * 100:.1f} %", fontsize=10)
    p = ex.plan.parallel
    fig.suptitle(f"{ex.model_name} on {ex.plan.cluster.num_gpus} x {ex.cluster.name}: dp {p.dp} tp {p.tp} "
                 f"pp {p.pp} cp {p.cp}, zero {p.zero}, recompute {p.recompute}", fontsize=11)
    fig.tight_layout()
    _save(fig, target)
    plt.close(fig)
    return target


def plot_sweep(points: Sequence["SweepPoint"], path: str | os.PathLike[str]) -> Path:
    """Left: tokens/s of each point's best plan (log-log against GPUs, with the linear-scaling line
    from the first point, when only the GPU count varies; else against the point labels). Right:
    scaling efficiency (tokens/s per GPU against the first point) and MFU, in %."""
    target = _check_target(path)
    plt = require_matplotlib()
    ok = [p for p in points if p.found is not None]
    if not ok:
        raise AutoparError("nothing to plot: no sweep point has a plan that fits")
    only_gpus = len({(p.global_batch, p.seq_len) for p in ok}) == 1 and len({p.gpus for p in ok}) == len(ok)
    tokens = [p.found.result.top[0].estimate.tokens_per_s for p in ok]
    mfu = [p.found.result.top[0].estimate.mfu * 100 for p in ok]
    eff = [p.tokens_per_s_per_gpu / ok[0].tokens_per_s_per_gpu * 100 for p in ok]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    if only_gpus:
        xs = [p.gpus for p in ok]
        ideal = [tokens[0] * n / xs[0] for n in xs]
        ax_t.plot(xs, ideal, linestyle="--", color="gray", label="linear from the first point")
        ax_t.plot(xs, tokens, marker="o", label="best plan")
        ax_t.set_yscale("log")
        for ax in (ax_t, ax_m):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{n:,}" for n in xs])
            ax.set_xlabel("GPUs")
    else:
        xs = list(range(len(ok)))
        labels = [f"{p.gpus} GPUs\nb{p.found.space.global_batch} s{p.found.space.seq_len}" for p in ok]
        ax_t.plot(xs, tokens, marker="o", label="best plan")
        for ax in (ax_t, ax_m):
            ax.set_xticks(xs, labels, fontsize=7)
    ax_m.plot(xs, eff, marker="o", label="scaling efficiency (tokens/s per GPU vs the first)")
    ax_m.plot(xs, mfu, marker="s", label="MFU")
    ax_t.set_ylabel("tokens / s")
    ax_t.legend(fontsize=8)
    ax_t.set_title("throughput of the best plan", fontsize=10)
    ax_m.set_ylabel("%")
    ax_m.set_ylim(0, max(110.0, math.ceil(max(eff + mfu) / 10) * 10 + 10))
    ax_m.legend(fontsize=8, loc="best")
    ax_m.set_title("scaling efficiency and MFU", fontsize=10)
    g = ok[0].found.graph
    fig.suptitle(f"{g.name} on {ok[0].found.cluster.name}: best plan per point", fontsize=11)
    fig.tight_layout()
    _save(fig, target)
    plt.close(fig)
    return target


def plot_time_to_target(rows: Sequence[TimeToTargetRow], path: str | Path, *, title: str = "") -> Path:
    """Time to target (hours, log) against the global batch, one line per GPU count, the best point
    ringed. Needs matplotlib (``autopar[plot]``): a one-line AutoparError without it."""
    from autopar.search.time_to_target import best_index

    target = _check_target(path)
    plt = require_matplotlib()
    timed = [r for r in rows if r.time_to_target_s is not None]
    if not timed:
        raise AutoparError("nothing to plot: no point has a plan that fits")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in sorted({r.gpus for r in timed}):
        mine = sorted((r for r in timed if r.gpus == n), key=lambda r: r.global_batch_samples)
        ax.plot([r.global_batch_samples for r in mine], [r.time_to_target_s / 3600 for r in mine], marker="o",
                label=f"{n:,} GPUs")
    best = rows[best_index(rows)]
    ax.plot([best.global_batch_samples], [best.time_to_target_s / 3600], marker="o", markersize=14,
            markerfacecolor="none", color="black", linestyle="none", label="least time to target")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    batches = sorted({r.global_batch_samples for r in timed})
    ax.set_xticks(batches, [f"{b:,}" for b in batches])
    ax.set_xlabel("global batch (samples)")
    ax.set_ylabel("time to target (hours)")
    ax.legend(fontsize=8)
    ax.set_title(title or "time to target: S(B) steps x the best plan's step time", fontsize=10)
    fig.tight_layout()
    _save(fig, target)
    plt.close(fig)
    return target
