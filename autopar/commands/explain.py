"""``autopar explain PLAN.yaml [MODEL.py] [--cluster NAME|PATH] [--trace out.json] [--plot FILE.png]``."""

from __future__ import annotations

import argparse
import json

from autopar.commands.args import check_moe_imbalance, warn
from autopar.errors import AutoparError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN.yaml", help="plan file (YAML v1)")
    p.add_argument("model", metavar="MODEL.py", nargs="?", help="model file (default: the plan's model.file)")
    p.add_argument("--cluster", metavar="NAME|PATH", help="cluster profile (default: the plan's cluster.profile)")
    p.add_argument("--trace", metavar="OUT.json",
                   help="also write the predicted pipeline timeline as a Chrome/Perfetto trace (Trace Event JSON)")
    p.add_argument("--groups", type=int, default=4, metavar="K", help="groups listed per mesh axis (default 4)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw memory per stage (stacked bars) and the step-time breakdown "
                        "(needs matplotlib: pip install 'autopar[plot]')")
    p.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F",
                   help="mixture of experts: price the plan at this routing imbalance (busiest ep rank's tokens "
                        "over the mean; default 1.0)")
    p.add_argument("--no-cache", action="store_true",
                   help="trace the model file again instead of reading its graph from the cache (~/.cache/autopar)")


def main(args: argparse.Namespace) -> int:
    from autopar import api
    from autopar.explain.explanation import format_explanation
    from autopar.explain.trace import simulate, trace_json
    from autopar.plan import write_text_atomic

    if args.groups < 1:
        raise AutoparError(f"--groups must be >= 1, got {args.groups}")
    check_moe_imbalance(args.moe_imbalance)
    if args.plot:
        from autopar.explain.plot import require_matplotlib

        require_matplotlib()  # before any work: the one-line hint when matplotlib is missing
        from autopar.outputs import check_output_file

        check_output_file(args.plot, "--plot")
    ex = api.explanation(args.plan, args.model, args.cluster, moe_imbalance=args.moe_imbalance,
                         use_cache=not args.no_cache, warn=warn)
    plan = ex.plan
    print(format_explanation(ex, max_groups=args.groups))
    if args.plot:
        from autopar.explain.plot import plot_explanation

        plot_explanation(ex, args.plot)
        print(f"\nmemory and time plot written to {args.plot}")
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
