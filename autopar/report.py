"""Plain-text tables and number formats for the CLI (no state, no I/O)."""

from __future__ import annotations

from typing import Sequence

from autopar.cost.step import Estimate
from autopar.plan import Plan

GIB = 2**30


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A fixed-width table; ``align`` has one char per column ('l' or 'r'), numbers default right."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if align is None:
        align = "".join("l" if i == 0 else "r" for i in range(len(headers)))
    lines = []
    for k, row in enumerate(cells):
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)]
        lines.append("  ".join(parts).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f}"


def param_count(n: float) -> str:
    """``174.62 B``, ``124.4 M``, ``6.1 K``: a parameter count a person reads at a glance."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f}"


def seconds(s: float) -> str:
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.1f} ms"
    return f"{s * 1e6:,.0f} us"


def plan_summary(plan: Plan) -> str:
    """One line: the parallel layout of a plan."""
    p, t = plan.parallel, plan.training
    parts = [f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}" + (f" ep={p.ep}" if p.ep > 1 else "")]  # expert parallelism
    if p.cp > 1:
        parts.append(f"cp {p.cp_kind}")
    if p.tp > 1:
        parts.append("sp on" if p.sequence_parallel else "sp off")
    parts.append(f"zero {p.zero}")
    if p.recompute_blocks is not None:  # per-stage recompute: the counts (explain's stage table has each)
        totals = [sum(c) for c in zip(*p.recompute_blocks)]
        parts.append("recompute per stage (" + ", ".join(
            f"{m} {k}" for m, k in zip(("none", "selective", "full"), totals) if k) + " blocks)")
    else:
        parts.append(f"recompute {p.recompute}")
    if p.offload.any:  # host offload
        parts.append(f"offload {p.offload.label}")
    if p.pp > 1:
        parts.append(p.pp_schedule + (f" v={p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else ""))
    parts.append(f"micro-batch {t.micro_batch_size} x {plan.num_microbatches}")
    return " | ".join(parts)


def plan_brief(plan: Plan) -> str:
    """``dp4 tp8 pp4 sp z1 mb4 v13 none``: a plan's layout in one table cell (benchmarks' tables)."""
    par, tr = plan.parallel, plan.training
    parts = [f"dp{par.dp}", f"tp{par.tp}", f"pp{par.pp}"]
    if par.cp > 1:
        parts.append(f"cp{par.cp}")
    if par.ep > 1:
        parts.append(f"ep{par.ep}")
    if par.tp > 1 and par.sequence_parallel:
        parts.append("sp")
    parts += [f"z{par.zero}", f"mb{tr.micro_batch_size}"]
    if par.pp > 1:
        parts.append(f"v{par.pp_virtual_stages}" if par.pp_virtual_stages > 1 else par.pp_schedule)
    parts.append(par.recompute if par.recompute_blocks is None else "mix")
    if par.offload.any:
        parts.append(f"off:{par.offload.label}")
    return " ".join(parts)


def estimate_report(plan: Plan, est: Estimate, model_name: str, num_params: float, cluster_name: str,
                    capacity_text: str) -> str:
    """The human-readable output of ``autopar estimate``; ``capacity_text``: what a plan may fill, as
    the CLI says it (autopar.cluster.usable_text: the margin named)."""
    out = [
        f"model    {model_name}: {param_count(num_params)} parameters, {plan.model.num_blocks} blocks, "
        f"seq {plan.training.seq_len}, global batch {plan.training.global_batch_size}, {plan.training.dtype}",
        f"cluster  {cluster_name}: {plan.cluster.num_gpus} GPUs, {plan.cluster.gpus_per_node} per node",
        f"plan     {plan_summary(plan)}",
        "",
        f"step time {seconds(est.step_time_s)}   tokens/s {est.tokens_per_s:,.0f}   MFU {est.mfu * 100:.1f} %   "
        f"bubble {est.bubble_fraction * 100:.1f} %",
        "",
    ]
    rows = [(k.replace("_", " "), seconds(v), f"{v / est.step_time_s * 100:.1f} %")
            for k, v in est.time_breakdown_s.items() if abs(v) > 0]
    out.append(table(["time per step", "seconds", "share"], rows))
    out.append("")
    stage_rows = []
    for r in est.ranks:
        m = r.memory_bytes
        stage_rows.append((r.rank, r.num_blocks, seconds(r.time_s), gib(m["params"]), gib(m["grads"]),
                           gib(m["optimizer"]), gib(m["activations"]), gib(m["other"]), gib(r.peak_bytes),
                           gib(est.capacity_bytes - r.peak_bytes)))
    out.append(table(["stage", "blocks", "fwd+bwd/mb", "params", "grads", "optimizer", "activations", "other",
                      "total GiB", "headroom"], stage_rows))
    verdict = "fits" if est.fits else "DOES NOT FIT"
    out.append("")
    out.append(f"peak memory {gib(est.peak_memory_bytes)} GiB of {capacity_text} per GPU: {verdict}")
    return "\n".join(out)
