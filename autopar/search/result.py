"""Turn search candidates into plan files and the ranked table ``autopar plan`` prints."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from autopar.cluster import Cluster, usable_text
from autopar.cost.estimate import estimate_json
from autopar.graph.model_graph import ModelGraph
from autopar.plan import RECOMPUTE_MODES, ClusterRef, ModelRef, Parallel, Plan, Training
from autopar.report import gib, param_count, seconds, table
from autopar.search.candidates import Candidate, SearchResult
from autopar.search.space import SearchSpace

_DTYPE_NAMES = {2: "bf16", 4: "fp32"}


def candidate_plan(cand: Candidate, mf: Any, cluster_name: str, gpus_per_node: int,
                   dtype: str | None = None, fixed: Mapping[str, tuple] | None = None) -> Plan:
    """A plan v1 for ``cand``, its stage split explicit, its prediction attached.

    ``mf`` is the model file (anything with ``path`` and ``sha256``: a ModelFile or the cache's
    ModelSource). ``fixed``: the user's constraints, recorded under ``prediction.search.fixed_by_user``
    (prediction is written, never read: old and new plans load alike)."""
    c = cand.config
    ranges, start = [], 0
    for n in cand.chunk_blocks:
        ranges.append((start, start + n))
        start += n
    plan = Plan(
        model=ModelRef(file=str(mf.path), num_blocks=sum(cand.chunk_blocks), sha256=mf.sha256),
        cluster=ClusterRef(profile=cluster_name, num_gpus=c.num_gpus, gpus_per_node=gpus_per_node),
        training=Training(global_batch_size=c.global_batch, micro_batch_size=c.micro_batch, seq_len=c.seq_len,
                          dtype=dtype or _DTYPE_NAMES.get(c.dtype_bytes, "bf16"), optimizer=c.optimizer),
        parallel=Parallel(dp=c.dp, tp=c.tp, pp=c.pp, cp=c.cp, cp_kind=c.cp_kind,
                          sequence_parallel=c.sequence_parallel, zero=c.zero, recompute=_plan_recompute(cand),
                          pp_schedule=c.schedule, pp_virtual_stages=c.virtual_stages,
                          stages=tuple(ranges) if c.pp > 1 else None, ep=c.ep,  # expert parallelism
                          recompute_blocks=cand.recompute_blocks,  # per-stage recompute
                          offload=c.offload),  # host offload
    )
    prediction = estimate_json(cand.estimate)
    prediction.pop("stages", None)
    prediction["search"] = {"ilp_status": cand.ilp_status, "ilp_objective_s": cand.ilp_objective_s,
                            "ilp_bound_s": cand.ilp_bound_s}
    if fixed:
        prediction["search"]["fixed_by_user"] = {k: list(v) for k, v in fixed.items()}
    return plan.with_prediction(prediction)


def _plan_recompute(cand: Candidate) -> str:
    """``parallel.recompute`` of the plan: a per-stage recompute mix writes its most frugal mode used, so a
    reader that ignores ``recompute_blocks`` still errs on the side of memory."""
    if cand.recompute_blocks is None:
        return cand.config.recompute
    used = [m for m, k in zip(RECOMPUTE_MODES, map(sum, zip(*cand.recompute_blocks))) if k > 0]
    return used[-1]


def recompute_text(cand: Candidate) -> str:
    """The table's recompute column: the mode, or a per-stage mix's block counts."""
    if cand.recompute_blocks is None:
        return cand.config.recompute
    totals = [sum(c) for c in zip(*cand.recompute_blocks)]
    return "mix " + "/".join(f"{k}{m[0]}" for m, k in zip(RECOMPUTE_MODES, totals) if k)


def _split_text(chunk_blocks: tuple[int, ...], pp: int) -> str:
    """Blocks per pipeline rank: "even", or the counts (the middle elided past 8 ranks)."""
    per_rank = [sum(chunk_blocks[r::pp]) for r in range(pp)]
    if len(set(per_rank)) <= 1:
        return "even"
    text = [str(n) for n in per_rank]
    if len(text) > 8:
        text = text[:4] + ["..."] + text[-2:]
    return "/".join(text)


def _schedule(c) -> str:  # noqa: ANN001
    if c.pp == 1:
        return "-"
    return "interleaved v=%d" % c.virtual_stages if c.schedule == "interleaved-1f1b" else c.schedule


# Table column of each constraint (plan --tp ...): its header is starred when the user fixed it.
_COLUMN_OF = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "cp_kind": "cp kind", "sp": "sp", "zero": "zero",
              "micro_batch": "mb", "schedule": "schedule", "virtual_stages": "schedule", "recompute": "recompute",
              "ep": "ep", "offload": "offload"}


def constraint_text(fixed: Mapping[str, tuple]) -> str:
    """``tp 8, pp 4, sp on``: the constraints as the user gave them."""
    def value(v: object) -> str:
        return ("on" if v else "off") if isinstance(v, bool) else str(v)

    return ", ".join(f"{k.replace('_', ' ')} {','.join(value(v) for v in vs)}" for k, vs in fixed.items())


def result_report(result: SearchResult, plans: list[Plan], graph: ModelGraph, cluster: Cluster,
                  space: SearchSpace, fixed: Mapping[str, tuple] | None = None,
                  extra: Mapping[str, Sequence[str]] | None = None) -> str:
    """The ranked table ``autopar plan`` prints; ``extra``: more columns (header -> one cell per
    plan), after the others (``plan --verify``'s rehearsed peak)."""
    fixed = fixed or {}
    rows = []
    for i, cand in enumerate(result.top, 1):
        c, e = cand.config, cand.estimate
        split = _split_text(cand.chunk_blocks, c.pp)
        rows.append((i, c.dp, c.tp, c.pp, c.cp, c.cp_kind if c.cp > 1 else "-",
                     "on" if c.sequence_parallel else "off" if c.tp > 1 else "-", c.zero, c.micro_batch,
                     _schedule(c), split if c.pp > 1 else "-", recompute_text(cand), f"{e.step_time_s:,.3f}",
                     f"{e.tokens_per_s:,.0f}", f"{e.mfu * 100:.1f}", gib(e.peak_memory_bytes), gib(e.headroom_bytes)))
    lines = [
        f"model    {graph.name}: {param_count(graph.num_params)} parameters, {graph.num_blocks} blocks, "
        f"seq {space.seq_len}, global batch {space.global_batch}",
        *([f"graph    traced at seq {graph.probe_seq_len} and {graph.probe_seq_len // 2} and extrapolated to seq "
           f"{graph.seq_len}: a forward at full length dispatches too many ops to trace (a loop over positions?)"]
          if graph.probe_seq_len else []),
        f"cluster  {cluster.name}: {space.num_gpus} GPUs, {cluster.gpus_per_node} per node, "
        f"{usable_text(cluster)} each",
        *([f"tp plan  {graph.tp_source}: "
           + ", ".join(f"{n} {s}" for n, s in graph.tp_styles.items())] if graph.tp_styles else
          ([f"tp plan  {graph.tp_source}"] if graph.tp_source else [])),
    ]
    starred = {_COLUMN_OF[k] for k in fixed}
    if fixed:
        lines.append(f"fixed    {constraint_text(fixed)} (by you; starred columns)")
    headers = ["#", "dp", "tp", "pp", "cp", "cp kind", "sp", "zero", "mb", "schedule", "blocks/rank", "recompute",
               "step s", "tokens/s", "MFU %", "peak GiB", "headroom"]
    align = "rrrrrllrrlllrrrrr"
    if graph.moe is not None:  # expert parallelism: an ep column for mixture-of-experts models (after cp)
        headers.insert(5, "ep")
        rows = [r[:5] + (cand.config.ep,) + r[5:] for r, cand in zip(rows, result.top)]
        align = align[:5] + "r" + align[5:]
    if any(cand.config.offload.any for cand in result.top):  # host offload: an offload column (after recompute)
        at = headers.index("recompute") + 1
        headers.insert(at, "offload")
        rows = [r[:at] + (cand.config.offload.label,) + r[at:] for r, cand in zip(rows, result.top)]
        align = align[:at] + "l" + align[at:]
        host = [getattr(c.estimate, "host", None) for c in result.top]
        headers.append("host GiB/node")
        rows = [r + (gib(h["host_memory_bytes"]) if h else "-",) for r, h in zip(rows, host)]
        align += "r"
    for head, cells in (extra or {}).items():
        headers.append(head)
        rows = [r + (cell,) for r, cell in zip(rows, cells)]
        align += "r"
    lines += [
        "",
        table([h + "*" if h in starred else h for h in headers], rows, align=align),
        "",
    ]
    best = result.top[0]
    status = "optimal" if result.optimal else "best found (an ILP hit its time limit)"
    lines.append(
        f"searched {result.num_configs:,} configurations in {result.elapsed_s:.2f} s: {result.num_evaluated:,} costed, "
        f"{result.num_ilp_solved:,} stage-split ILPs; result {status} under the cost model"
        + (f" (recompute mixes: the top {result.num_mixes_refined} single-mode plans solved again)"
           if result.num_mixes_refined else "")
    )
    lines.append(
        f"best plan: ILP status {best.ilp_status}, objective {seconds(best.ilp_objective_s)}, "
        f"bound {seconds(best.ilp_bound_s)}"
    )
    if result.rejected:
        lines.append("rejected: " + "; ".join(f"{n:,} {why}" for why, n in
                                               sorted(result.rejected.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)
