"""``autopar estimate [MODEL.py] PLAN.yaml``: the cost model's prediction for a plan, and where it
ranks among the plans ``autopar plan`` searches for the same request (``--json``: the contract object).
"""

from __future__ import annotations

import argparse
import json

from autopar.cluster import usable_text
from autopar.commands.args import check_moe_imbalance, positive_int, warn
from autopar.engines.capability import EXPORT_ENGINES
from autopar.errors import AutoparError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from autopar.usercode import add_timeout_argument

    p.add_argument("model", metavar="MODEL.py", nargs="?", help="model file (default: the plan's model.file)")
    p.add_argument("plan", metavar="PLAN.yaml", nargs="?", help="plan file (YAML v1); not with --from")
    f = p.add_argument_group("an engine's configuration (--from)", "price the configuration you run today instead of "
                             "a plan: 'autopar estimate MODEL.py --from megatron FLAGS_FILE' (docs/engines.md)")
    f.add_argument("--from", dest="from_", nargs=2, metavar=("ENGINE", "FILE"),
                   help=f"read FILE as ENGINE's configuration ({', '.join(EXPORT_ENGINES)}): Megatron-LM flags or "
                        f"launch line, a torchtitan TOML or 0.3 overrides, a DeepSpeed JSON, an accelerate config")
    f.add_argument("--gpus", type=positive_int, metavar="N", help="with --from: the GPU count, where the file has none")
    f.add_argument("--gpus-per-node", type=positive_int, metavar="G", help="with --from: GPUs per node")
    f.add_argument("--global-batch", type=positive_int, metavar="B", help="with --from: the global batch (samples)")
    f.add_argument("--micro-batch", type=positive_int, metavar="M", help="with --from: the micro-batch (samples)")
    f.add_argument("--seq-len", type=positive_int, metavar="S", help="with --from: tokens per sample")
    p.add_argument("--cluster", metavar="NAME|PATH", help="cluster profile (default: the plan's cluster.profile)")
    p.add_argument("--profile", metavar="PATH",
                   help="measured profile (autopar profile) layered over the cluster profile, or a full one")
    p.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F",
                   help="mixture of experts: the busiest expert-parallel rank's token load over the mean "
                        "(default 1.0, balanced routing; as autopar plan's), pricing ep > 1")
    p.add_argument("--json", action="store_true", help="print one JSON object (the estimate --json contract)")
    p.add_argument("--no-rank", action="store_true",
                   help="do not search for where the plan ranks among autopar's plans (text output only)")
    p.add_argument("--no-cache", action="store_true",
                   help="trace the model file again instead of reading its graph from the cache (~/.cache/autopar)")
    add_timeout_argument(p)


RANK_TOP_K = 20  # estimate ranks a hand plan among this many of the fastest searched plans


def main(args: argparse.Namespace) -> int:
    from autopar import api
    from autopar.cost.estimate import estimate_json
    from autopar.report import estimate_report
    from autopar.usercode import configure, stdout_to_stderr

    check_moe_imbalance(args.moe_imbalance)
    configure(timeout_s=args.timeout)
    if args.from_:
        return _estimate_from(args)
    given = [k for k in ("gpus", "gpus_per_node", "global_batch", "micro_batch", "seq_len") if getattr(args, k)]
    if given:
        raise AutoparError(f"--{given[0].replace('_', '-')} is for --from (a plan states it); edit the plan instead")
    if args.plan is None:
        if args.model and args.model.endswith((".yaml", ".yml")):
            args.model, args.plan = None, args.model
        else:
            raise AutoparError("give PLAN.yaml (autopar estimate [MODEL.py] PLAN.yaml), or an engine's "
                               "configuration with --from ENGINE FILE")
    if args.model and args.model.endswith((".yaml", ".yml")) and args.plan.endswith(".py"):
        # PLAN.yaml MODEL.py, the order of run / validate / explain: take it as meant
        args.model, args.plan = args.plan, args.model
    options = dict(profile=args.profile, moe_imbalance=args.moe_imbalance, use_cache=not args.no_cache, warn=warn)
    if args.json:  # nothing but the JSON object on stdout, whatever the model file prints
        with stdout_to_stderr():
            est = api.estimation(args.model, args.plan, args.cluster, **options)
        print(json.dumps(estimate_json(est.estimate), indent=2))
        return 0
    est = api.estimation(args.model, args.plan, args.cluster, **options)
    print(estimate_report(est.plan, est.estimate, est.graph.name, est.graph.num_params, est.cluster.name,
                          usable_text(est.cluster)))
    if est.estimate.moe:
        print(_moe_text(est.estimate.moe))
    if not args.no_rank:
        print("")
        print(_rank_text(est, args))
    return 0


def _moe_text(moe) -> str:  # noqa: ANN001 - estimate --json's "moe" (autopar.cost.expert.moe_summary)
    """One line on an expert-parallel plan's all-to-alls and routing imbalance."""
    gemm = moe["expert_gemm_s_per_step"]
    return (f"experts  ep {moe['ep']} over {moe['a2a_link']}, priced at routing imbalance {moe['imbalance']:g}: "
            f"{moe['a2a_bytes_per_step'] / 2**30:,.1f} GiB of all-to-all sent per GPU per step, "
            f"{moe['a2a_s_per_step']:.3f} s exposed; the imbalance adds {moe['imbalance_s_per_step']:.3f} s over "
            f"balanced routing; the experts' ep-shaped GEMMs {'save' if gemm <= 0 else 'add'} {abs(gemm):.3f} s "
            f"(autopar explain: the step time at other imbalances)")


def _rank_text(est, args: argparse.Namespace, engine: str = "autopar") -> str:  # noqa: ANN001 - an api.Estimation
    """Where the plan of ``est`` ranks among the plans ``autopar plan`` searches for the same request
    (GPUs, GPUs per node, global batch, sequence, dtype, optimizer; with ``engine``, among the plans
    that engine runs) and how far it is from the best, with what the best changes."""
    from autopar import api
    from autopar.errors import InfeasibleError
    from autopar.search import cp_sat_process
    from autopar.search.sweep import plan_text

    try:
        with cp_sat_process.overlapped():
            found = api.rank(est, top=RANK_TOP_K, use_cache=not args.no_cache, engine=engine)
    except InfeasibleError:
        return "ranking: no searched plan fits memory for this request either"
    except AutoparError as exc:
        return f"ranking: not available ({exc})"
    top = found.result.top
    best = top[0]
    mine = est.estimate.step_time_s
    faster = [c for c in top if c.step_time_s < mine * (1 - 1e-9)]
    searched = f"{found.result.num_configs:,} configurations searched in {found.result.elapsed_s:.2f} s"
    layout = f"{plan_text(found)} ({best.step_time_s:,.3f} s, {best.estimate.mfu * 100:.1f} % MFU)"
    if not est.estimate.fits:
        return f"ranking: this plan does not fit memory; the best searched plan is {layout} [{searched}]"
    if not faster:
        return f"ranking: #1 -- no searched plan is faster (the best searched is {layout}) [{searched}]"
    gap = (mine / best.step_time_s - 1) * 100
    where = (f"#{len(faster) + 1} of the searched plans ({len(faster)} faster)" if len(faster) < len(top)
             else f"below the {len(top)} fastest searched plans")
    among = "" if engine == "autopar" else f" (among the plans {engine} runs)"
    return (f"ranking{among}: {where}; the best, {layout}, is {gap:,.1f} % faster "
            f"(this plan takes {mine / best.step_time_s:,.2f}x its step time): "
            f"{plan_changes(est.plan, found.plans[0])} [{searched}]")


def _estimate_from(args: argparse.Namespace) -> int:
    """``estimate MODEL.py --from ENGINE FILE``: the engine's file priced as a plan, what was not read
    listed in one line, and where it ranks among the plans that engine runs."""
    from autopar import api
    from autopar.cost.estimate import estimate_json
    from autopar.engines.capability import get_engine
    from autopar.plan import plan_to_dict
    from autopar.report import estimate_report
    from autopar.usercode import stdout_to_stderr

    engine, path = args.from_
    if engine not in EXPORT_ENGINES:
        raise AutoparError(f"unknown engine {engine!r} for --from; use one of {', '.join(EXPORT_ENGINES)}")
    model = args.model if args.plan is None else None
    if model is None or not model.endswith(".py"):
        raise AutoparError("--from prices an engine's file for a model: give MODEL.py and no plan "
                           "(autopar estimate MODEL.py --from ENGINE FILE)")
    options = dict(gpus=args.gpus, gpus_per_node=args.gpus_per_node, global_batch=args.global_batch,
                   micro_batch=args.micro_batch, seq_len=args.seq_len, moe_imbalance=args.moe_imbalance,
                   use_cache=not args.no_cache, warn=warn)
    if args.json:
        with stdout_to_stderr():
            imp = api.estimation_from(engine, path, model, args.cluster, **options)
        out = estimate_json(imp.estimation.estimate)
        out["imported"] = {"engine": engine, "file": str(path), "plan": plan_to_dict(imp.estimation.plan),
                           "not_read": list(imp.config.ignored)}
        print(json.dumps(out, indent=2))
        return 0
    imp = api.estimation_from(engine, path, model, args.cluster, **options)
    est = imp.estimation
    # the plan it runs is the report's "plan" line (report.plan_summary); only the GPU count is said here
    print(f"read     {get_engine(engine).title} configuration {path}: {est.plan.cluster.num_gpus} GPUs")
    if imp.config.ignored:
        print(f"not read {', '.join(imp.config.ignored)} (settings that do not change what autopar prices, "
              f"or that the model file describes)")
    print(estimate_report(est.plan, est.estimate, est.graph.name, est.graph.num_params, est.cluster.name,
                          usable_text(est.cluster)))
    if not args.no_rank:
        print("")
        print(_rank_text(est, args, engine=engine))
    return 0


def plan_changes(mine, best) -> str:  # noqa: ANN001 - two Plans
    """What ``best`` changes from ``mine``, e.g. "cp 2 instead of 1, tp 4 instead of 8"."""
    a, b = mine.parallel, best.parallel
    fields = [("dp", a.dp, b.dp), ("tp", a.tp, b.tp), ("pp", a.pp, b.pp), ("cp", a.cp, b.cp),
              ("ep", a.ep, b.ep), ("zero", a.zero, b.zero),
              ("sequence parallel", a.sequence_parallel and a.tp > 1, b.sequence_parallel and b.tp > 1),
              ("micro-batch", mine.training.micro_batch_size, best.training.micro_batch_size),
              ("schedule", _schedule(a), _schedule(b)),
              ("recompute", a.recompute if a.recompute_blocks is None else "per stage",
               b.recompute if b.recompute_blocks is None else "per stage"),
              ("offload", a.offload.label, b.offload.label)]
    if a.cp > 1 and b.cp > 1:
        fields.append(("cp kind", a.cp_kind, b.cp_kind))
    changed = [f"{name} {new} instead of {old}" for name, old, new in fields if old != new]
    if not changed and mine.stage_ranges() != best.stage_ranges():
        changed.append("another stage split")
    return ", ".join(changed) or "nothing in the layout"


def _schedule(par) -> str:  # noqa: ANN001 - a Parallel
    if par.pp == 1:
        return "-"
    return f"interleaved v={par.pp_virtual_stages}" if par.pp_virtual_stages > 1 else par.pp_schedule
