"""``autopar launch PLAN.yaml --nnodes N --master-addr HOST [--master-port P] [--slurm] [--model MODEL.py]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from autopar.launch.commands import DEFAULT_PORT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN.yaml", help="plan file (YAML v1)")
    p.add_argument("--nnodes", type=int, required=True, metavar="N", help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, metavar="G",
                   help="processes per node (default: the plan's cluster.gpus_per_node)")
    p.add_argument("--master-addr", metavar="HOST", help="host name or IP of node 0 (optional with --slurm)")
    p.add_argument("--master-port", type=int, default=DEFAULT_PORT, metavar="P", help=f"default {DEFAULT_PORT}")
    p.add_argument("--model", metavar="MODEL.py", help="model file passed to autopar run (default: the plan's)")
    p.add_argument("--steps", type=int, metavar="S", help="passed to autopar run --steps")
    p.add_argument("--slurm", action="store_true", help="print an sbatch script instead of per-node lines")
    p.add_argument("--time", metavar="HH:MM:SS", help="with --slurm: #SBATCH --time")


def main(args: argparse.Namespace) -> int:
    from autopar.launch.commands import (
        Launch,
        check_safe_text,
        check_slurm_time,
        check_world_size,
        sbatch_script,
        torchrun_lines,
    )
    from autopar.plan import load_plan

    check_safe_text("plan path", args.plan)  # before anything reads it: a newline would inject a script line
    if args.time is not None:
        check_slurm_time(args.time)
    plan = load_plan(args.plan)
    gpn = args.gpus_per_node or plan.cluster.gpus_per_node
    check_world_size(plan, args.nnodes, gpn)
    run_args: list[str] = [args.model] if args.model else []
    if args.steps is not None:
        run_args += ["--steps", str(args.steps)]
    launch = Launch(plan_path=args.plan, nnodes=args.nnodes, nproc_per_node=gpn, master_addr=args.master_addr,
                    master_port=args.master_port, run_args=tuple(run_args))
    if args.slurm:
        print(sbatch_script(launch, job_name=f"autopar-{Path(args.plan).stem}", time_limit=args.time), end="")
        return 0
    lines = torchrun_lines(launch)
    stride = gpn
    for i, line in enumerate(lines):
        print(f"# node {i} (global ranks {i * stride}-{(i + 1) * stride - 1})")
        print(line)
    return 0
