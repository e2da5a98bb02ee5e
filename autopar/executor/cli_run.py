"""``autopar run PLAN.yaml [MODEL.py]``: apply a plan to the real model and train a few steps.

Launch modes:

* under ``torchrun`` (``WORLD_SIZE``/``RANK`` set): every rank runs the plan;
* ``--nproc-per-node N`` outside torchrun: checks the plan here, then re-launches itself with
  ``python -m torch.distributed.run --standalone --nproc-per-node N -m autopar.executor.cli_run``;
* a 1-GPU plan with neither: runs in this process (a world of one).

Everything that can be wrong (world size, a plan for another model, tp not dividing the heads, ...)
is checked before ``init_process_group`` -- a one-line ``AutoparError``, never a hang. Rank 0 logs
each step, prints measured vs predicted (the plan's ``prediction`` mapping: ``step_time_s``,
``tokens_per_s``, ``peak_memory_bytes`` when present) and writes the JSON report (``--report``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError

DEFAULT_STEPS, DEFAULT_LR, DEFAULT_SEED = 3, 1e-3, 0


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.yaml", help="plan file (YAML v1)")
    parser.add_argument("model", metavar="MODEL.py", nargs="?", help="model file (default: the plan's model.file)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weights and synthetic data seed (default 0)")
    parser.add_argument("--nproc-per-node", type=int, metavar="N",
                        help="start N processes with torchrun (when not already under torchrun)")
    parser.add_argument("--report", metavar="PATH", help="write the JSON run report here (rank 0)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="collective timeout in seconds (default 600)")


def _under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _model_path(args: argparse.Namespace, plan_path: Path, plan_file: str) -> str:
    if args.model:
        return args.model
    p = Path(plan_file)
    if not p.is_absolute() and not p.exists() and (plan_path.parent / p).exists():
        return str(plan_path.parent / p)  # model.file relative to the plan
    return plan_file


def _relaunch(args: argparse.Namespace, model: str) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}",
           "-m", "autopar.executor.cli_run", args.plan, model, "--steps", str(args.steps), "--lr", repr(args.lr),
           "--seed", str(args.seed), "--timeout", repr(args.timeout)]
    if args.report:
        cmd += ["--report", args.report]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(cmd, env=env)


def run_main(args: argparse.Namespace) -> int:
    """Entry point of ``autopar run`` (see the module docstring). Returns the exit code."""
    from autopar.executor.checks import check_world_size, preflight
    from autopar.modelfile import load_model_file
    from autopar.plan import load_plan

    if args.steps < 1:
        raise AutoparError(f"--steps must be >= 1, got {args.steps}")
    plan = load_plan(args.plan)
    model = _model_path(args, Path(args.plan), plan.model.file)
    mf = load_model_file(model)
    if _under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
    elif args.nproc_per_node is not None:
        check_world_size(plan, args.nproc_per_node)
        _, warnings = preflight(plan, mf, args.nproc_per_node)
        for w in warnings:
            print(f"autopar: {w}", file=sys.stderr)
        if args.nproc_per_node > 1:
            return _relaunch(args, model)
        world = 1
    else:
        world = 1
    check_world_size(plan, world)
    spec, warnings = preflight(plan, mf, world)
    return _run_distributed(args, plan, mf, spec, warnings, world)


def _run_distributed(args: argparse.Namespace, plan, mf, spec, warnings: list[str], world: int) -> int:
    import torch
    import torch.distributed as dist

    from autopar.executor.apply import build_executable
    from autopar.executor.mesh import backend_for, build_mesh, device_for_rank
    from autopar.executor.train import train

    device = device_for_rank()
    if world == 1 and not _under_torchrun():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    import warnings as _warnings

    # FSDP2 warns on every wrapped block that returns a view; the executor never mutates outputs.
    _warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=args.timeout))
    try:
        rank0 = dist.get_rank() == 0
        log = (lambda s: print(f"autopar run: {s}", flush=True)) if rank0 else None
        if rank0:
            for w in warnings:
                print(f"autopar: {w}", file=sys.stderr)
        mesh = build_mesh(plan, device)
        exe = build_executable(plan, mf, spec, mesh, seed=args.seed, lr=args.lr, loss_fn=mf.loss_fn)
        if log:
            for note in exe.notes:
                log(f"note: {note}")
        result = train(exe, mf, steps=args.steps, seed=args.seed, log=log)
        if rank0:
            report = build_report(plan, str(mf.path), result, world, args, warnings)
            print(format_comparison(report), flush=True)
            if args.report:
                from autopar.plan import write_text_atomic

                write_text_atomic(args.report, json.dumps(report, indent=2) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error_pct(measured: float, predicted: Any) -> float | None:
    if not isinstance(predicted, (int, float)) or isinstance(predicted, bool) or predicted == 0:
        return None
    return 100.0 * (measured - predicted) / predicted


def read_prediction(plan_path: str) -> dict[str, Any]:
    """The plan file's ``prediction`` mapping (load_plan ignores it by contract, so read it here)."""
    import yaml

    try:
        data = yaml.safe_load(Path(plan_path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    pred = data.get("prediction") if isinstance(data, dict) else None
    return dict(pred) if isinstance(pred, dict) else {}


def build_report(plan, model_path: str, result, world: int, args: argparse.Namespace, warnings: list[str]) -> dict[str, Any]:
    """The JSON report (rank 0): what ran, what was measured, the prediction and the errors in %."""
    pred = dict(plan.prediction or {}) or read_prediction(args.plan)
    measured = {
        "step_time_s": result.step_time_s,
        "tokens_per_s": result.tokens_per_s,
        "peak_memory_bytes": max(result.peak_memory_bytes),
    }
    return {
        "plan": str(args.plan),
        "model": model_path,
        "world_size": world,
        "steps": args.steps,
        "seed": args.seed,
        "lr": args.lr,
        "parallel": {k: getattr(plan.parallel, k) for k in ("dp", "tp", "pp", "cp", "zero", "recompute", "pp_schedule")},
        "losses": list(result.losses),
        "step_times_s": list(result.step_times_s),
        "measured": measured,
        "peak_memory_bytes_per_rank": list(result.peak_memory_bytes),
        "memory_measure": result.memory_measure,
        "predicted": {k: pred[k] for k in measured if k in pred},
        "error_pct": {k: _error_pct(v, pred.get(k)) for k, v in measured.items() if k in pred},
        "notes": list(result.notes),
        "warnings": warnings,
    }


def format_comparison(report: dict[str, Any]) -> str:
    m, p, e = report["measured"], report["predicted"], report["error_pct"]
    units = {"step_time_s": ("step time", lambda v: f"{v:.4f} s"),
             "tokens_per_s": ("tokens/s", lambda v: f"{v:,.0f}"),
             "peak_memory_bytes": ("peak memory", lambda v: f"{v / 2**20:,.1f} MiB")}
    lines = ["measured vs predicted:", f"  {'':12s} {'measured':>16s} {'predicted':>16s} {'error':>9s}"]
    for key, (label, fmt) in units.items():
        pv = fmt(p[key]) if key in p else "-"
        ev = f"{e[key]:+.1f}%" if e.get(key) is not None else "-"
        lines.append(f"  {label:12s} {fmt(m[key]):>16s} {pv:>16s} {ev:>9s}")
    lines.append(f"  (memory: {report['memory_measure']}, max over ranks; step time: mean after the first step)")
    return "\n".join(lines)


def standalone_main(argv: list[str] | None = None) -> int:
    """Standalone entry used by the torchrun re-launch (and usable without autopar.cli)."""
    parser = argparse.ArgumentParser(prog="autopar run")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_main(args)
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return exc.exit_code


# The interface autopar.cli expects of a command module.
add_arguments = add_run_arguments
main = run_main

if __name__ == "__main__":
    raise SystemExit(standalone_main())
