"""``autopar estimate [MODEL.py] PLAN.yaml``: the cost model's prediction for a plan, and where it
ranks among the plans ``autopar plan`` searches for the same request (``--json``: the contract object).
"""

from __future__ import annotations

import argparse
import json

from autopar.commands.args import check_moe_imbalance, warn
from autopar.errors import AutoparError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from autopar.usercode import add_timeout_argument

    p.add_argument("model", metavar="MODEL.py", nargs="?", help="model file (default: the plan's model.file)")
    p.add_argument("plan", metavar="PLAN.yaml", help="plan file (YAML v1)")
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

    if args.model and args.model.endswith((".yaml", ".yml")) and args.plan.endswith(".py"):
        # PLAN.yaml MODEL.py, the order of run / validate / explain: take it as meant
        args.model, args.plan = args.plan, args.model
    check_moe_imbalance(args.moe_imbalance)
    configure(timeout_s=args.timeout)
    options = dict(profile=args.profile, moe_imbalance=args.moe_imbalance, use_cache=not args.no_cache, warn=warn)
    if args.json:  # nothing but the JSON object on stdout, whatever the model file prints
        with stdout_to_stderr():
            est = api.estimation(args.model, args.plan, args.cluster, **options)
        print(json.dumps(estimate_json(est.estimate), indent=2))
        return 0
    est = api.estimation(args.model, args.plan, args.cluster, **options)
    print(estimate_report(est.plan, est.estimate, est.graph.name, est.graph.num_params, est.cluster.name))
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


def _rank_text(est, args: argparse.Namespace) -> str:  # noqa: ANN001 - an api.Estimation
    """Where the plan of ``est`` ranks among the plans ``autopar plan`` searches for the same request
    (GPUs, GPUs per node, global batch, sequence, dtype, optimizer) and how far it is from the best."""
    from autopar import api
    from autopar.errors import InfeasibleError
    from autopar.search import cp_sat_process
    from autopar.search.sweep import plan_text

    try:
        with cp_sat_process.overlapped():
            found = api.rank(est, top=RANK_TOP_K, use_cache=not args.no_cache)
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
    return (f"ranking: {where}; the best, {layout}, is {gap:,.1f} % faster "
            f"(this plan takes {mine / best.step_time_s:,.2f}x its step time) [{searched}]")
