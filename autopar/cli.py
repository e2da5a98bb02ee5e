"""autopar's command line: the only module that reads argv and prints.

Exit codes: 0 success; 2 bad input, including a request no plan can meet ("no plan fits ...": a
one-line ``autopar: error: ...`` on stderr, nothing written); 4 a rank died or a collective hung during ``autopar run``
(autopar.executor.faults, autopar.launch.local); 128 + signal when interrupted (130 SIGINT, 143 SIGTERM);
1 an internal error (a bug: please report it). The whole contract: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Sequence

from autopar import __version__
from autopar.errors import AutoparError

EXIT_OK, EXIT_USAGE = 0, 2  # 1 is Python's own for an uncaught error; 4 is the executor's (faults.py)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what is wrong and where to look), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _warn(message: str) -> None:
    print(f"autopar: warning: {message}", file=sys.stderr)


RANK_TOP_K = 20  # estimate ranks a hand plan among this many of the fastest searched plans


def cmd_estimate(args: argparse.Namespace) -> int:
    from autopar.cost.estimate import estimate_json
    from autopar.report import estimate_report
    from autopar.usercode import configure, stdout_to_stderr

    if args.model and args.model.endswith((".yaml", ".yml")) and args.plan.endswith(".py"):
        # PLAN.yaml MODEL.py, the order of run / validate / explain: take it as meant
        args.model, args.plan = args.plan, args.model
    configure(timeout_s=args.timeout)
    if args.json:  # nothing but the JSON object on stdout, whatever the model file prints
        with stdout_to_stderr():
            est, plan, graph, cluster, _ = _estimate(args)
        print(json.dumps(estimate_json(est), indent=2))
        return EXIT_OK
    est, plan, graph, cluster, model = _estimate(args)
    print(estimate_report(plan, est, graph.name, graph.num_params, cluster.name))
    if not args.no_rank:
        print("")
        print(_rank_text(plan, est, model, cluster, args))
    return EXIT_OK


def _estimate(args: argparse.Namespace):  # noqa: ANN202
    """(estimate, plan, graph, cluster, model path); the graph through the cache (model code, and
    its example_inputs check, run only on a miss: graph/cache.py)."""
    from autopar.api import plan_model_path
    from autopar.cluster import load_cluster_and_profile
    from autopar.cost.compute import measured_table_warning
    from autopar.cost.estimate import estimate_plan
    from autopar.plan import load_plan
    from autopar.search.driver import load_graph

    plan = load_plan(args.plan)
    cluster = load_cluster_and_profile(args.cluster, args.profile, plan.cluster.profile)
    from autopar.profile_conditions import RunConditions, price_for_run, ranks_on_host

    run = RunConditions(dtype=plan.training.dtype, ranks_on_host=ranks_on_host(
        cluster, plan.cluster.num_gpus, plan.cluster.gpus_per_node))
    priced = price_for_run(cluster, run, profile_label=args.profile or args.cluster or plan.cluster.profile,
                           model_label=args.model or plan.model.file)
    for w in priced.warnings:
        _warn(w)
    cluster = priced.cluster
    if args.cluster is None and args.profile is None and plan.cluster.gpus_per_node != cluster.gpus_per_node:
        _warn(f"plan has {plan.cluster.gpus_per_node} GPUs per node, profile {cluster.name} has {cluster.gpus_per_node}")
    model = args.model or plan_model_path(plan, args.plan)
    graph, source = load_graph(model, seq_len=plan.training.seq_len, dtype=plan.training.dtype,
                               use_cache=not args.no_cache)
    if plan.model.sha256 and plan.model.sha256 != source.sha256:
        _warn(f"{source.path} changed since the plan was made (sha256 differs); the estimate is for the file as it is now")
    note = measured_table_warning(graph, cluster)
    if note:
        _warn(note)
    return estimate_plan(plan, graph, cluster), plan, graph, cluster, model


def _rank_text(plan, est, model, cluster, args: argparse.Namespace) -> str:  # noqa: ANN001
    """Where ``plan`` ranks among the plans ``autopar plan`` searches for the same request
    (GPUs, GPUs per node, global batch, sequence, dtype, optimizer) and how far it is from the best."""
    from autopar.errors import InfeasibleError
    from autopar.search.driver import search_plans
    from autopar.search.sweep import plan_text

    t = plan.training
    try:
        found = search_plans(model, gpus=plan.cluster.num_gpus, cluster=cluster, cluster_ref=cluster.name,
                             gpus_per_node=plan.cluster.gpus_per_node, global_batch=t.global_batch_size,
                             seq_len=t.seq_len, dtype=t.dtype, optimizer=t.optimizer, top_k=RANK_TOP_K,
                             use_cache=not args.no_cache)
    except InfeasibleError:
        return "ranking: no searched plan fits memory for this request either"
    except AutoparError as exc:
        return f"ranking: not available ({exc})"
    top = found.result.top
    best = top[0]
    mine = est.step_time_s
    faster = [c for c in top if c.step_time_s < mine * (1 - 1e-9)]
    searched = f"{found.result.num_configs:,} configurations searched in {found.result.elapsed_s:.2f} s"
    layout = f"{plan_text(found)} ({best.step_time_s:,.3f} s, {best.estimate.mfu * 100:.1f} % MFU)"
    if not est.fits:
        return f"ranking: this plan does not fit memory; the best searched plan is {layout} [{searched}]"
    if not faster:
        return f"ranking: #1 -- no searched plan is faster (the best searched is {layout}) [{searched}]"
    gap = (mine / best.step_time_s - 1) * 100
    where = (f"#{len(faster) + 1} of the searched plans ({len(faster)} faster)" if len(faster) < len(top)
             else f"below the {len(top)} fastest searched plans")
    return (f"ranking: {where}; the best, {layout}, is {gap:,.1f} % faster "
            f"(this plan takes {mine / best.step_time_s:,.2f}x its step time) [{searched}]")


def cmd_profiles(args: argparse.Namespace) -> int:
    from autopar.cluster import list_profiles, load_cluster
    from autopar.report import table

    rows = []
    for name, path in sorted(list_profiles().items()):
        c = load_cluster(str(path))
        rows.append((name, c.gpu_name, f"{c.peak_flops / 1e12:,.0f}", f"{c.memory_bytes / 2**30:,.0f}",
                     f"{c.memory_bandwidth_bytes_per_s / 1e12:.2f}", c.gpus_per_node,
                     f"{c.intra_node.bandwidth_bytes_per_s / 1e9:,.0f}", f"{c.inter_node.bandwidth_bytes_per_s / 1e9:,.0f}",
                     str(path)))
    print(table(["profile", "gpu", "TFLOP/s", "GiB", "HBM TB/s", "gpus/node", "NVLink GB/s", "NIC GB/s/gpu", "file"],
                rows, align="llrrrrrrl"))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The full parser: built-in commands plus every command module present."""
    from autopar.usercode import add_timeout_argument

    parser = _Parser(prog="autopar", description="Plan and run hybrid-parallel PyTorch training.",
                     epilog="exit codes: 0 ok, 2 bad input or no plan fits memory, 4 a rank died or hung, "
                            "130/143 interrupted, 1 internal error (docs/reliability.md)")
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("estimate", help="predict step time, MFU and memory of a plan",
                       description="Predict the step time, tokens/s, MFU and per-GPU memory of PLAN for MODEL. "
                                   "PLAN.yaml MODEL.py (the order of run, validate and explain) is accepted too.")
    p.add_argument("model", metavar="MODEL.py", nargs="?", help="model file (default: the plan's model.file)")
    p.add_argument("plan", metavar="PLAN.yaml", help="plan file (YAML v1)")
    p.add_argument("--cluster", metavar="NAME|PATH", help="cluster profile (default: the plan's cluster.profile)")
    p.add_argument("--profile", metavar="PATH",
                   help="measured profile (autopar profile) layered over the cluster profile, or a full one")
    p.add_argument("--json", action="store_true", help="print one JSON object (the estimate --json contract)")
    p.add_argument("--no-rank", action="store_true",
                   help="do not search for where the plan ranks among autopar's plans (text output only)")
    p.add_argument("--no-cache", action="store_true",
                   help="trace the model file again instead of reading its graph from the cache (~/.cache/autopar)")
    add_timeout_argument(p)
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("profiles", help="list the cluster profiles with their key figures",
                       description="List shipped and local cluster profiles (./profiles, $AUTOPAR_PROFILES).")
    p.set_defaults(func=cmd_profiles)

    _add_optional_commands(sub)
    return parser


# Commands that live in their own packages: (name, module, help, description). Each module defines
# add_arguments(parser) and main(args) -> exit code; a module not present is not offered.
_COMMANDS = (
    ("plan", "autopar.search.cli_plan", "search the fastest plan that fits memory",
     "Search (branch and bound, exact stage-split ILP) for the fastest plan of MODEL on N GPUs and write it "
     "as plan YAML v1; lists in --gpus/--global-batch/--seq-len sweep, --tp/--pp/... constrain."),
    ("run", "autopar.executor.cli_run", "train with a plan (torch.distributed)",
     "Apply PLAN to the model and train for a few steps; report measured vs predicted."),
    ("profile", "autopar.profiler.cli_profile", "measure per-layer compute/memory or collectives",
     "Measure per-layer times and memory on the local device, or collectives under torchrun (--comm)."),
    ("validate", "autopar.profiler.cli_validate", "run a plan briefly and compare with its prediction",
     "Run PLAN for a few steps and print predicted vs measured step time and peak memory per rank."),
    ("explain", "autopar.explain.cli", "show a plan's mesh, stages, memory and communication",
     "Explain PLAN: rank groups per mesh axis, layers per stage, memory and communication per step."),
    ("launch", "autopar.launch.cli", "print the torchrun lines or an sbatch script for a plan",
     "Print the per-node torchrun command lines (or a Slurm sbatch script) that run PLAN."),
)


def _add_optional_commands(sub: argparse._SubParsersAction) -> None:
    for name, module_name, help_text, description in _COMMANDS:
        try:
            if importlib.util.find_spec(module_name) is None:
                continue
        except ModuleNotFoundError:  # its package is not there either
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=description)
        module.add_arguments(p)
        p.set_defaults(func=module.main)


def main(argv: Sequence[str] | None = None) -> int:
    from autopar.usercode import configure

    parser = build_parser()
    args = parser.parse_args(argv)
    configure(hard_exit=True)  # a model-file call that ignores its time limit ends the process (usercode.py)
    try:
        return int(args.func(args) or 0)
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK


def exit_process(code: int) -> None:
    """Exit with ``code``. Under torchrun (``TORCHELASTIC_RUN_ID`` set), once the command has
    returned -- process group destroyed, reports written -- the rank leaves with ``os._exit`` after
    flushing its streams: at interpreter teardown a native thread of the distributed stack was, now
    and then, destroyed while still joinable ("terminate called without an active exception", a
    SIGABRT after the run had succeeded: about 1 CPU run in 20 here), which made torchrun report a
    failed job. Elsewhere: a normal exit."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        raise SystemExit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
