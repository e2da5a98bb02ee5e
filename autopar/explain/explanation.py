"""``autopar explain``: everything about one plan in readable tables.

``explain_plan`` gathers the facts (mesh groups, stage layout, the cost model's estimate, the
communication volume); ``format_explanation`` turns them into text. Both are pure: no I/O, no argv.
Every number comes from the cost model (``cost.estimate`` / ``cost.stage``), so ``explain`` and
``estimate`` can never disagree: the memory columns of each stage sum to that stage's peak and the
largest is the estimate's ``peak_memory_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.cost.estimate import config_from_plan, estimate_plan
from autopar.cost.stage import StageTerms, build_terms
from autopar.cost.step import Estimate, chunk_rank
from autopar.cost.zero import describe as describe_zero
from autopar.explain.mesh import AxisSummary, format_group, mesh_summary
from autopar.explain.trace import chunk_modes, chunk_times
from autopar.explain.volume import StageVolume, communication_volume
from autopar.graph.model_graph import ModelGraph, MoEFacts
from autopar.layout import EXPERT_AXES
from autopar.plan import Plan
from autopar.report import gib, param_count, plan_summary, seconds, table

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "other")
_AXIS_TITLE = {"tp": "tensor (tp)", "cp": "context (cp)", "dp": "data (dp)", "dp_cp": "grad/ZeRO (dp x cp)",
               "pp": "pipeline (pp)"}


@dataclass(frozen=True, kw_only=True)
class Explanation:
    """The facts ``autopar explain`` prints."""

    plan: Plan
    model_name: str
    num_params: float
    cluster: Cluster
    estimate: Estimate
    terms: StageTerms
    mesh: tuple[AxisSummary, ...]
    volume: tuple[StageVolume, ...]
    # Expert parallelism: the blocks' experts (None: dense) and the plan priced at several imbalance factors
    moe: MoEFacts | None = None
    imbalance: float = 1.0
    imbalance_effect: tuple[tuple[float, Estimate], ...] = ()
    carried: tuple[str, ...] = ()  # the prologue outputs a pipeline stage receives beside the hidden state

    def axis(self, name: str) -> AxisSummary:
        return next(a for a in self.mesh if a.axis == name)


def explain_plan(plan: Plan, graph: ModelGraph, cluster: Cluster, moe_imbalance: float = 1.0) -> Explanation:
    """Gather the explanation of ``plan`` for ``graph`` on ``cluster`` (raises PlanError if the
    plan does not fit the model, like ``estimate``). ``moe_imbalance``: the expert-parallel
    imbalance factor the plan is priced at (autopar.cost.expert)."""
    est = estimate_plan(plan, graph, cluster, moe_imbalance)
    terms = build_terms(graph, cluster, config_from_plan(plan, moe_imbalance))
    effect: tuple[tuple[float, Estimate], ...] = ()
    if graph.moe is not None and plan.parallel.ep > 1:  # expert parallelism: what routing imbalance would cost
        factors = sorted({1.0, 1.1, 1.25, 1.5, float(moe_imbalance)})
        effect = tuple((f, est if f == moe_imbalance else estimate_plan(plan, graph, cluster, f)) for f in factors)
    return Explanation(plan=plan, model_name=graph.name, num_params=graph.num_params, cluster=cluster,
                       estimate=est, terms=terms, mesh=mesh_summary(plan, cluster),
                       volume=communication_volume(plan, graph, cluster, terms), moe=graph.moe,
                       imbalance=float(moe_imbalance), imbalance_effect=effect,
                       carried=tuple(q.what for q in graph.carried))


def format_explanation(ex: Explanation, *, max_groups: int = 4) -> str:
    """The text of ``autopar explain``; at most ``max_groups`` groups listed per axis (then a count)."""
    plan, est = ex.plan, ex.estimate
    out = [
        f"model    {ex.model_name}: {param_count(ex.num_params)} parameters, {plan.model.num_blocks} blocks, "
        f"seq {plan.training.seq_len}, global batch {plan.training.global_batch_size}, {plan.training.dtype}",
        f"cluster  {ex.cluster.name}: {plan.cluster.num_gpus} GPUs on {plan.cluster.num_nodes} node(s), "
        f"{plan.cluster.gpus_per_node} per node (node = rank // {plan.cluster.gpus_per_node})",
        f"plan     {plan_summary(plan)}",
        "",
        f"step time {seconds(est.step_time_s)}   tokens/s {est.tokens_per_s:,.0f}   MFU {est.mfu * 100:.1f} %   "
        f"bubble {est.bubble_fraction * 100:.1f} %",
        "",
        "== mesh: ranks laid out [pp, dp, cp, tp], tp innermost ==",
        _mesh_table(ex),
        "",
        *_group_lines(ex, max_groups),
        "",
        "== pipeline stages ==",
        _stage_table(ex),
        *_carried_lines(ex),
        "",
        *_memory_section(ex),
        f"peak {gib(est.peak_memory_bytes)} GiB of {gib(est.capacity_bytes)} GiB: "
        + ("fits" if est.fits else "DOES NOT FIT"),
        "",
    ]
    out += _comm_section(ex)
    out += _moe_section(ex)  # expert parallelism
    out += _offload_section(ex)  # host offload
    out += ["", "== time per step ==", _time_table(est)]
    return "\n".join(out)


def _offload_section(ex: Explanation) -> list[str]:
    """Host offload: host memory per node and the offload traffic of one step (only for offload plans)."""
    host = getattr(ex.estimate, "host", None)
    if not host:
        return []
    off, gpn = ex.terms.offload, ex.plan.cluster.gpus_per_node
    what = {"optimizer": "optimizer states + fp32 master on the host, Adam on the CPU; gradients down and "
                         "parameters up once per step",
            "params": "FSDP2 CPUOffloadPolicy: sharded params, grads and optimizer states on the host; "
                      "each all-gather copies its shard up, each reduce-scatter its gradient shard down"}
    base = ex.plan.parallel.offload.label.replace("+activations", "")
    lines = ["", f"== offload: {ex.plan.parallel.offload.label} =="]
    if base in what:
        lines.append(f"{base}: {what[base]}")
    if ex.plan.parallel.offload.activations:
        lines.append(f"activations: each block's saved tensors on the host, {gib(off.host_act_bytes_per_block)} GiB "
                     f"per block per micro-batch, down in forward and up in backward "
                     f"({seconds(off.act_copy_s_per_block)} per block per micro-batch, not overlapped)")
    lines += [
        f"host memory {gib(host['host_memory_bytes'])} GiB per node of {gib(host['host_capacity_bytes'])} GiB "
        f"({gib(host['host_memory_bytes_per_gpu'])} GiB for the fullest GPU x up to {gpn} GPUs): "
        + ("fits" if host["host_memory_bytes"] <= host["host_capacity_bytes"] else "DOES NOT FIT"),
        f"offload traffic {gib(host['offload_traffic_bytes_per_gpu'])} GiB per GPU per step over the host link "
        f"({off.link_bandwidth_bytes_per_s / 1e9:,.1f} GB/s per GPU): {seconds(host['offload_copy_s'])} of copies; "
        f"CPU optimizer step {seconds(host['cpu_optimizer_s'])}",
    ]
    return lines


def _mesh_table(ex: Explanation) -> str:
    rows = []
    for a in ex.mesh:
        if a.axis == "dp_cp" and ex.plan.parallel.cp == 1:
            continue  # the same groups as dp
        rows.append((_AXIS_TITLE[a.axis], a.size, f"{a.num_groups:,}", a.stride, a.nodes_per_group,
                     a.link if a.size > 1 else "-",
                     f"{a.bandwidth_bytes_per_s / 1e9:,.0f}" if a.size > 1 else "-"))
    return table(["axis", "size", "groups", "stride", "nodes/group", "link", "GB/s per GPU"], rows, align="lrrrrlr")


def _group_lines(ex: Explanation, max_groups: int) -> list[str]:
    gpn = ex.plan.cluster.gpus_per_node
    lines = []
    for a in ex.mesh:
        if a.size == 1 or (a.axis == "dp_cp" and ex.plan.parallel.cp == 1):
            continue
        shown = a.groups[:max_groups]
        label = a.axis + " groups"
        per_line = 2 if a.size <= 4 else 1
        for k in range(0, len(shown), per_line):
            lines.append(f"{label if k == 0 else '':15s}" + "  ".join(format_group(g, gpn) for g in shown[k:k + per_line]))
        if a.num_groups > len(shown):
            lines.append(" " * 15 + f"... {a.num_groups - len(shown):,} more ({a.num_groups:,} groups of {a.size})")
    return lines or ["(one GPU: no groups)"]


def elided(n: int, keep: tuple[int, ...] = (), limit: int = 8) -> list[int]:
    """Indices 0..n-1 to print: all when n <= limit, else the first 3, the last 2 and ``keep``,
    with -1 wherever some were left out."""
    if n <= limit:
        return list(range(n))
    wanted = sorted({0, 1, 2, n - 2, n - 1, *keep})
    out: list[int] = []
    for i in wanted:
        if out and i != out[-1] + 1:
            out.append(-1)
        out.append(i)
    return out


def _stage_table(ex: Explanation) -> str:
    plan, terms = ex.plan, ex.terms
    par = plan.parallel
    ranges = plan.stage_ranges()
    times = chunk_times(terms, [e - s for s, e in ranges], chunk_modes(plan))
    modes = chunk_modes(plan)  # per-stage recompute: each chunk's recompute counts, in the "also" column
    stride = par.dp * par.cp * par.tp
    gpn = plan.cluster.gpus_per_node
    rows: list[tuple] = []
    for r in elided(par.pp):
        if r < 0:
            rows.append(("...",) + ("",) * 9)
            continue
        first, last_rank = r * stride, (r + 1) * stride - 1
        nodes = f"{first // gpn}" if first // gpn == last_rank // gpn else f"{first // gpn}-{last_rank // gpn}"
        for c in range(len(ranges)):
            if chunk_rank(c, par.pp) != r:
                continue
            start, end = ranges[c]
            extra = [x for x, on in (("embedding", c == 0), ("head+loss", c == len(ranges) - 1)) if on]
            if modes is not None:
                extra.append("recompute " + " ".join(f"{m} {k}" for m, k in sorted(
                    modes[c].items(), key=lambda mk: ("full", "selective", "none").index(mk[0]))))
            f, b, rc = times[c]
            rows.append((r, c, f"{start}-{end - 1}", end - start, ", ".join(extra) or "-", seconds(f), seconds(b),
                         seconds(rc) if rc else "-", f"{first}-{last_rank}", nodes))
    return table(["stage", "chunk", "blocks", "n", "also", "fwd/mb", "bwd/mb", "of it recompute", "ranks", "nodes"],
                 rows, align="rrlrlrrrll")


def _memory_section(ex: Explanation) -> list[str]:
    """The per-stage breakdown in GiB, or in MiB when the peak is under 10 GiB (small models)."""
    unit, size = ("GiB", 2**30) if ex.estimate.peak_memory_bytes >= 10 * 2**30 else ("MiB", 2**20)
    rows: list[tuple] = []
    peak = max(ex.estimate.ranks, key=lambda rk: rk.peak_bytes).rank
    for r in elided(len(ex.estimate.ranks), keep=(peak,)):
        if r < 0:
            rows.append(("...",) + ("",) * (len(MEMORY_KEYS) + 2))
            continue
        rk = ex.estimate.ranks[r]
        rows.append((rk.rank, rk.num_blocks, *(f"{rk.memory_bytes[k] / size:,.1f}" for k in MEMORY_KEYS),
                     f"{rk.peak_bytes / size:,.1f}"))
    return [f"== memory per GPU ({unit}), by pipeline stage ==",
            table(["stage", "blocks", *MEMORY_KEYS, "total"], rows),
            describe_zero(config_from_plan(ex.plan), ex.plan.parallel.zero)]


def _human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def _carried_lines(ex: Explanation) -> list[str]:
    """What a stage receives beside the hidden state (``ModelGraph.carried``), where anything is."""
    if ex.terms.carried_bytes <= 0:
        return []
    return [f"carried beside the hidden state: {_human_bytes(ex.terms.carried_bytes)} per micro-batch "
            f"({', '.join(ex.carried)}), in each send between stages (p2p {seconds(ex.terms.p2p_s)}) "
            "and each receiving stage's buffers"]


def _comm_section(ex: Explanation) -> list[str]:
    busiest = max(ex.volume, key=lambda v: v.sent_bytes_per_step)
    lines = [f"== communication per step, one GPU of stage {busiest.rank} (the busiest) =="]
    if not busiest.items:
        return lines + ["(none: a single GPU)"]
    rows = [(i.what, i.collective.replace("_", "-"), i.axis, i.link, i.group_size, f"{i.calls_per_step:,.0f}",
             _human_bytes(i.message_bytes), _human_bytes(i.sent_bytes_per_step), seconds(i.time_s_per_step))
            for i in busiest.items]
    lines.append(table(["what", "collective", "axis", "link", "group", "calls", "message", "sent/step",
                        "time alone"], rows, align="lllllrrrr"))
    lines += ["", "sent per GPU per step, by stage and axis:"]
    axes = [a for a in ("tp", "cp", "dp_cp", "pp", *EXPERT_AXES) if any(a in v.by_axis() for v in ex.volume)]
    links = {a.axis: a.link for a in ex.mesh}
    links.update({i.axis: i.link for v in ex.volume for i in v.items if i.axis not in links})  # ep, edp (expert parallelism)
    shown = [None if r < 0 else ex.volume[r] for r in elided(len(ex.volume), keep=(busiest.rank,))]
    rows = [("...", *("" for _ in axes), "") if v is None else
            (v.rank, *(_human_bytes(v.by_axis().get(a, 0.0)) for a in axes), _human_bytes(v.sent_bytes_per_step))
            for v in shown]
    lines.append(table(["stage", *(f"{a} ({links[a]})" for a in axes), "total"], rows))
    return lines


def _moe_section(ex: Explanation) -> list[str]:
    """The experts' layout, the all-to-all volume per step and the imbalance factor's effect."""
    moe, par = ex.moe, ex.plan.parallel
    if moe is None:
        return []
    lines = ["", f"== experts: {moe.num_experts} per block, top-{moe.top_k}, ep {par.ep} =="]
    if par.ep == 1 or ex.estimate.moe is None:
        return lines + [f"every rank holds all {moe.num_experts} experts of its blocks (no all-to-all); "
                        "routing imbalance costs nothing at ep 1"]
    m = ex.estimate.moe
    edp = par.layout.size("edp")  # autopar.layout owns the expert axes
    lines += [
        f"{moe.num_experts // par.ep} of {moe.num_experts} experts per rank "
        f"({param_count(m['expert_params_per_rank'])} expert parameters), the same on the {edp} rank(s) "
        + ("of its edp group (dp x cp x tp / ep: under sequence parallelism each tp rank routes its own "
           "sequence shard), " if par.layout.folds_tp else "of its edp group (dp x cp / ep), ")
        + "which reduce their gradients and shard their ZeRO states",
        f"all-to-all over the ep group of {par.ep} ({m['a2a_link']}): "
        f"{_human_bytes(m['a2a_bytes_per_step'])} sent per GPU per step (dispatch + combine in forward and backward"
        + (", and again in the full recompute), " if par.recompute == "full" else "), ")
        + f"{seconds(m['a2a_s_per_step'])} exposed",
        "",
        f"routing imbalance (the busiest ep rank's tokens over the mean; this plan priced at {ex.imbalance:g}):",
    ]
    base = ex.imbalance_effect[0][1].step_time_s if ex.imbalance_effect else ex.estimate.step_time_s
    rows = [(f"{f:g}" + (" *" if f == ex.imbalance else ""), seconds(e.step_time_s),
             f"{(e.step_time_s / base - 1) * 100:+.1f} %", _human_bytes(e.moe["a2a_bytes_per_step"]) if e.moe else "-",
             f"{e.tokens_per_s:,.0f}")
            for f, e in ex.imbalance_effect]
    lines.append(table(["imbalance", "step s", "vs balanced", "all-to-all/step", "tokens/s"], rows, align="lrrrr"))
    return lines


def _time_table(est: Estimate) -> str:
    rows = [(k.replace("_", " "), seconds(v), f"{v / est.step_time_s * 100:.1f} %")
            for k, v in est.time_breakdown_s.items() if abs(v) > 0]
    return table(["part", "seconds", "share"], rows)
