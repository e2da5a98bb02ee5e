"""``autopar run PLAN.yaml [MODEL.py]``: apply a plan to the real model and train a few steps.

Launch modes:

* under ``torchrun`` (``WORLD_SIZE``/``RANK`` set): every rank runs the plan;
* ``--nproc-per-node N`` outside torchrun: checks the plan here, then starts N ranks of
  ``python -m autopar run`` with autopar's loopback launcher (launch/local.py);
* a 1-GPU plan with neither: runs in this process (a world of one).

Checkpoints (``--checkpoint-dir``, ``--checkpoint-every``, ``--resume``), restarts
(``--max-restarts``), hang timeouts and ``--trace``: see checkpoint.py, faults.py, tracing.py and
docs/reliability.md. ``--steps`` is the total step count, also when resuming.

Everything that can be wrong (arguments, world size, a plan for another model, tp not dividing the heads, ...)
is checked before ``init_process_group`` -- a one-line ``AutoparError``, never a hang. Rank 0 logs
each step, prints measured vs predicted (the plan's ``prediction`` mapping: ``step_time_s``,
``tokens_per_s``, ``peak_memory_bytes`` when present) and writes the JSON report (``--report``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.executor.runtime.run_options import (
    DEFAULT_LR,
    DEFAULT_MAX_LOSS_RATIO,
    DEFAULT_SEED,
    DEFAULT_STEPS,
    RunOptions,
)

_LOCKS: list[Any] = []  # checkpoint-directory locks of this process (checkpoint.lock_directory)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.yaml", help="plan file (YAML v1)")
    parser.add_argument("model", metavar="MODEL.py", nargs="?", help="model file (default: the plan's model.file)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR})")
    parser.add_argument("--max-loss-ratio", type=float, default=DEFAULT_MAX_LOSS_RATIO, metavar="R",
                        help=f"stop (exit 2, last good checkpoint kept) when a step's loss exceeds R times the "
                             f"first step's: training diverged (default {DEFAULT_MAX_LOSS_RATIO:g}; 0 never stops)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weights and synthetic data seed (default 0)")
    parser.add_argument("--nproc-per-node", type=int, metavar="N",
                        help="start N rank processes on this node (autopar's loopback launcher; not needed under torchrun)")
    parser.add_argument("--report", metavar="PATH", help="write the JSON run report here (rank 0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="where the ranks train: cuda (one GPU per rank, NCCL), cpu (gloo), or auto: cuda when "
                             "present (default; also $AUTOPAR_DEVICE)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="collective timeout in seconds (default 600): a hang becomes an error naming the rank "
                             "and the collective (exit 4); also the time limit of each call into the model file")
    g = parser.add_argument_group("batch size: AdaScale (docs/batch-size.md)")
    g.add_argument("--adascale", action="store_true",
                   help="multiply the learning rate by AdaScale's gain ratio each step (dp >= 2; SGD, as FairScale)")
    g.add_argument("--adascale-target", type=float, metavar="T",
                   help="with --adascale: train until the scale-invariant step counter reaches T (instead of --steps)")
    g.add_argument("--adascale-force", action="store_true",
                   help="with --adascale: run it with Adam(W) too, for which AdaScale is not validated")
    g = parser.add_argument_group("checkpoints and faults (docs/reliability.md)")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="write sharded DCP checkpoints here (atomic; 'latest' pointer)")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="save every K steps (default 0: only after the last step)")
    g.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                   help="keep the N newest checkpoints (default 2; 0 keeps all)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --checkpoint-dir (any plan: reshards); "
                        "--steps is the total step count. After a restart (--max-restarts) this happens automatically")
    g.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="with --nproc-per-node: restart the job R times after a rank fails (resuming from the latest checkpoint)")
    g = parser.add_argument_group("checking a plan against one rank")
    g.add_argument("--grad-norms", action="store_true",
                   help="write each parameter's first-step gradient norm (reduced, before the optimizer step) "
                        "into the --report JSON, to compare with the same run on one rank")
    g = parser.add_argument_group("tracing")
    g.add_argument("--trace", metavar="OUT.json", help="write rank 0's measured torch.profiler trace (Chrome format)")
    g.add_argument("--trace-steps", type=int, default=2, metavar="K", help="steps to trace after one warm-up (default 2)")
    g.add_argument("--trace-all-ranks", action="store_true", help="every rank r writes OUT.rank{r}.json")


def _under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _model_path(args: argparse.Namespace, plan_path: Path, plan_file: str) -> str:
    from autopar.plan import model_path

    return args.model or model_path(plan_file, plan_path)


def _relaunch(args: argparse.Namespace, model: str) -> int:
    """Start ``--nproc-per-node`` ranks of ``autopar run`` with autopar's launcher (launch/local.py:
    loopback only, one line and exit 4 for a dead or hung rank, signals forwarded, restarts)."""
    from autopar.launch.local import LocalJob, run_local

    cmd = ["-m", "autopar", "run", args.plan, model, "--steps", str(args.steps), "--lr", repr(args.lr),
           "--seed", str(args.seed), "--timeout", repr(args.timeout), "--max-loss-ratio", repr(args.max_loss_ratio)]
    for flag, value in (("--report", args.report), ("--checkpoint-dir", args.checkpoint_dir), ("--trace", args.trace)):
        if value is not None:
            cmd += [flag, str(value)]
    cmd += ["--checkpoint-every", str(args.checkpoint_every), "--keep-checkpoints", str(args.keep_checkpoints),
            "--trace-steps", str(args.trace_steps)]
    cmd += [f for f, on in (("--resume", args.resume), ("--trace-all-ranks", args.trace_all_ranks),
                            ("--adascale", args.adascale), ("--adascale-force", args.adascale_force),
                            ("--grad-norms", args.grad_norms)) if on]
    if args.adascale_target is not None:
        cmd += ["--adascale-target", repr(args.adascale_target)]
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "AUTOPAR_CKPT_LOCKED": "1"}
    return run_local(LocalJob(argv=tuple(cmd), nproc=args.nproc_per_node, max_restarts=args.max_restarts, env=env))


def set_device_choice(device: str | None, nproc: int | None) -> None:
    """``--device`` for this process and the ranks it starts (``AUTOPAR_DEVICE``), checked against the
    GPUs this host shows before any rank starts (one line, not an invalid-ordinal traceback)."""
    from autopar.executor.parallel.mesh import DEVICE_ENV

    if device is not None:
        os.environ[DEVICE_ENV] = device
    choice = os.environ.get(DEVICE_ENV, "auto")
    if choice == "cpu" or nproc is None or _under_torchrun():
        return
    import torch

    if not torch.cuda.is_available():
        if choice == "cuda":
            raise AutoparError("--device cuda: no CUDA device is visible here; use --device cpu")
        return
    if nproc > torch.cuda.device_count():
        raise AutoparError(f"--nproc-per-node {nproc} needs {nproc} GPUs (one per rank) but this host shows "
                           f"{torch.cuda.device_count()}; start fewer ranks, or train on the CPU with --device cpu")


def validate_args(args: argparse.Namespace) -> RunOptions:
    """Every argument of ``autopar run`` checked before any work (one-line AutoparError), every
    output location included: ``--report``, ``--trace`` and ``--checkpoint-dir`` must be writable
    regular files / a directory now, not after training. Returns the ranks' options."""
    from autopar.outputs import check_output_dir, check_output_file

    options = RunOptions.from_args(args)  # --steps, --lr, --timeout and the checkpoint/trace counts
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise AutoparError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.max_restarts < 0:
        raise AutoparError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.checkpoint_dir is not None:
        check_output_dir(args.checkpoint_dir, "--checkpoint-dir")
    for flag, value in (("--report", args.report), ("--trace", args.trace)):
        if value is not None:
            check_output_file(value, flag, create_parent=False)
    if args.trace is not None and args.trace_all_ranks:
        from autopar.executor.runtime.tracing import trace_path

        for r in range(args.nproc_per_node or 1):
            check_output_file(trace_path(args.trace, r, True), "--trace", create_parent=False)
    return options


def check_adascale(options: RunOptions, plan) -> list[str]:  # noqa: ANN001
    """``--adascale`` against the plan (before any rank starts): it needs measured gradient statistics
    (dp >= 2, cp 1, ep 1) and an optimizer it is validated for. Returns warnings to print."""
    if not options.adascale:
        return []
    par = plan.parallel
    if par.dp < 2:
        raise AutoparError(f"--adascale needs data parallelism (dp >= 2): it compares the ranks' local gradients, "
                           f"and this plan has dp {par.dp}; plan with more data-parallel ranks or run without --adascale")
    for name, degree, why in (("cp", par.cp, "a cp rank's gradient covers part of each sample's tokens"),
                              ("ep", par.ep, "experts reduce their gradients over their own groups")):
        if degree > 1:
            raise AutoparError(f"--adascale is not supported with {name} {degree} ({why}); run without --adascale")
    if plan.training.optimizer in ("adam", "adamw"):
        line = (f"AdaScale is not validated for Adam(W) (this plan's optimizer: {plan.training.optimizer}), only for "
                "SGD with or without momentum, as FairScale documents")
        if not options.adascale_force:
            raise AutoparError(f"{line}; plan with 'optimizer: sgd', or pass --adascale-force to run it anyway")
        return [f"warning: {line}; running it anyway (--adascale-force)"]
    return []


def _check_resume(args: argparse.Namespace, plan) -> list[str]:
    """--resume needs a complete checkpoint of a compatible model (found before launch)."""
    from autopar.executor.checkpoint.checkpoint_meta import META, CheckpointError, CheckpointMeta
    from autopar.executor.checkpoint.integrity import candidates

    if args.checkpoint_dir is None or not Path(args.checkpoint_dir).is_dir():
        if args.resume:
            raise CheckpointError(f"--resume: no complete checkpoint in {args.checkpoint_dir}")
        return []
    # The newest checkpoint whose record reads; the ranks check sizes and checksums (integrity.choose).
    latest, meta = None, None
    for path in candidates(Path(args.checkpoint_dir)):
        try:
            meta = CheckpointMeta.from_file(path / META)
        except CheckpointError:
            continue
        latest = path
        break
    if latest is None or meta is None:
        if args.resume:
            raise CheckpointError(f"--resume: no complete checkpoint in {args.checkpoint_dir}")
        return []
    if meta.num_blocks != plan.model.num_blocks:
        raise CheckpointError(
            f"{latest} holds a model with {meta.num_blocks} blocks but the plan's has {plan.model.num_blocks}; "
            "use another --checkpoint-dir"
        )
    warnings = []
    if meta.global_batch_size != plan.training.global_batch_size:
        warnings.append(f"warning: {latest} was trained with global batch {meta.global_batch_size}, the plan uses "
                        f"{plan.training.global_batch_size}; the data stream changes from step {meta.step + 1}")
    return warnings


def main(args: argparse.Namespace) -> int:
    """Entry point of ``autopar run`` (see the module docstring). Returns the exit code."""
    from autopar.executor.runtime.checks import check_world_size, preflight
    from autopar.launch.environment import check_environment
    from autopar.launch.rank import arm_parent_death_signal
    from autopar.modelcheck import check_example_inputs
    from autopar.modelfile import load_model_file
    from autopar.plan import load_plan
    from autopar.usercode import configure

    arm_parent_death_signal()  # a rank of autopar's launcher dies with it (a no-op elsewhere)
    options = validate_args(args)
    check_environment(args.nproc_per_node)  # before any rank starts: a stale or partial torchrun environment
    set_device_choice(args.device, args.nproc_per_node)
    configure(timeout_s=args.timeout)  # the model file's import, build_model and example_inputs too
    plan = load_plan(args.plan)
    if plan.parallel.ep > 1 and args.checkpoint_dir is not None:  # DCP would take ep-sharded experts for replicas
        raise AutoparError("checkpoints of expert-parallel plans (ep > 1) are not supported yet; "
                           "run without --checkpoint-dir or plan with ep = 1")
    if plan.parallel.offload.optimizer and not plan.parallel.offload.params and args.checkpoint_dir is not None:
        # Host offload: HostOptimizer's states belong to its host masters, not to the model's parameters
        raise AutoparError("checkpoints of plans with optimizer-only offload are not supported yet; "
                           "run without --checkpoint-dir or offload params too (zero 3)")
    adascale_warnings = check_adascale(options, plan)
    model = _model_path(args, Path(args.plan), plan.model.file)
    mf = load_model_file(model)
    if not _under_torchrun():
        check_example_inputs(mf)
    resume_warnings = _check_resume(args, plan) + adascale_warnings
    if args.checkpoint_dir is not None and os.environ.get("AUTOPAR_CKPT_LOCKED") != "1" and (
            not _under_torchrun() or os.environ.get("RANK") == "0"):
        from autopar.executor.checkpoint.checkpoint import lock_directory

        _LOCKS.append(lock_directory(args.checkpoint_dir))  # held until this process exits
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
    from autopar.executor.runtime.rank_main import run_rank

    return run_rank(options, plan, mf, spec, warnings + resume_warnings, world)

