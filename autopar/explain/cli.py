"""``autopar explain PLAN.yaml [MODEL.py] [--cluster NAME|PATH] [--trace out.json]`` (thin over autopar.api)."""

from __future__ import annotations

import argparse
import json
import sys

from autopar.errors import AutoparError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN.yaml", help="plan file (YAML v1)")
    p.add_argument("model", metavar="MODEL.py", nargs="?", help="model file (default: the plan's model.file)")
    p.add_argument("--cluster", metavar="NAME|PATH", help="cluster profile (default: the plan's cluster.profile)")
    p.add_argument("--trace", metavar="OUT.json",
                   help="also write the predicted pipeline timeline as a Chrome/Perfetto trace (Trace Event JSON)")
    p.add_argument("--groups", type=int, default=4, metavar="K", help="groups listed per mesh axis (default 4)")


def main(args: argparse.Namespace) -> int:
    from autopar import api
    from autopar.explain.explanation import format_explanation
    from autopar.explain.trace import simulate, trace_json
    from autopar.plan import load_plan, write_text_atomic

    if args.groups < 1:
        raise AutoparError(f"--groups must be >= 1, got {args.groups}")
    plan = load_plan(args.plan)
    model = args.model or api.plan_model_path(plan, args.plan)
    mf = api.load_model(model)
    if plan.model.sha256 and plan.model.sha256 != mf.sha256:
        print(f"autopar: warning: {mf.path} changed since the plan was made (sha256 differs)", file=sys.stderr)
    cluster = api.cluster_for(plan, args.cluster)
    if plan.cluster.gpus_per_node != cluster.gpus_per_node:
        print(f"autopar: warning: plan has {plan.cluster.gpus_per_node} GPUs per node, profile {cluster.name} has "
              f"{cluster.gpus_per_node}; links are costed with the profile's", file=sys.stderr)
    ex = api.explanation(plan, mf, cluster)
    print(format_explanation(ex, max_groups=args.groups))
    if args.trace:
        timeline = simulate(plan, ex.terms, ex.estimate)
        try:
            write_text_atomic(args.trace, json.dumps(trace_json(plan, timeline)) + "\n")
        except OSError as exc:
            raise AutoparError(f"cannot write {args.trace}: {exc.strerror}") from None
        n = sum(1 for e in timeline.events if e.category in ("forward", "backward"))
        print(f"\npredicted timeline ({n:,} forward/backward events, pipeline {timeline.pipeline_s * 1e3:,.2f} ms, "
              f"step {timeline.step_s * 1e3:,.2f} ms) written to {args.trace}: open it in https://ui.perfetto.dev")
    return 0
