"""What every rank of ``autopar run`` does once the arguments are validated (cli_run.py).

init_process_group (flight recorder on) -> mesh -> executable -> per-group timeouts -> resume
(``--resume``, or automatically after a torchrun restart) -> train with checkpoint / trace / fault
hooks -> report (rank 0) -> destroy_process_group (always).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from autopar.errors import AutoparError


@dataclass(frozen=True, kw_only=True)
class ResumeDecision:
    """Where this attempt starts: a checkpoint path, or None (from the seed)."""

    path: Path | None
    reason: str


def resume_decision(checkpoint_dir: str | None, resume: bool) -> ResumeDecision:
    """``--resume`` or a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) with a complete checkpoint
    in ``checkpoint_dir`` resumes from it; ``--resume`` without one is an error (found before launch
    by cli_run)."""
    from autopar.executor.checkpoint import CheckpointError, find_latest
    from autopar.executor.faults import first_attempt

    if checkpoint_dir is None:
        return ResumeDecision(path=None, reason="no --checkpoint-dir")
    latest = find_latest(checkpoint_dir)
    if resume and latest is None:
        raise CheckpointError(f"--resume: no complete checkpoint in {checkpoint_dir}")
    if latest is not None and (resume or not first_attempt()):
        why = "--resume" if resume else f"torchrun restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
        return ResumeDecision(path=latest, reason=why)
    return ResumeDecision(path=None, reason="fresh start")


def _init_process_group(backend: str, timeout: timedelta) -> None:
    """init_process_group; under a torchrun agent store, with keys private to this restart attempt.

    torchrun (c10d rendezvous, torch 2.13) hands every attempt the same agent TCPStore without a
    per-attempt prefix, so after a restart gloo would read the dead attempt's peer addresses and
    fail to connect ("Connection refused"). A PrefixStore per TORCHELASTIC_RESTART_COUNT avoids it.
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"/autopar/attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)


def run_rank(args: argparse.Namespace, plan, mf, spec, warnings: list[str], world: int,
             build_report: Callable[..., dict[str, Any]], format_comparison: Callable[[dict[str, Any]], str]) -> int:
    import torch
    import torch.distributed as dist

    from autopar.executor.apply import build_executable
    from autopar.executor.checkpoint import Checkpointer, load
    from autopar.executor.faults import Watchdog, enable_flight_recorder, inject_fault, set_group_timeouts
    from autopar.executor.mesh import backend_for, build_mesh, device_for_rank
    from autopar.executor.tracing import make_tracer
    from autopar.executor.train import StepHooks, train

    device = device_for_rank()
    if world == 1 and "RANK" not in os.environ:
        from autopar.executor.cli_run import _free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    import warnings as _warnings

    # FSDP2 warns on every wrapped block that returns a view; the executor never mutates outputs.
    _warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    enable_flight_recorder()
    _init_process_group(backend_for(device), timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    watchdog = Watchdog(rank, limit_s=2 * args.timeout + 60, timeout_s=args.timeout)
    tracer = None
    try:
        rank0 = rank == 0
        log = (lambda s: print(f"autopar run: {s}", flush=True)) if rank0 else None
        if rank0:
            for w in warnings:
                print(f"autopar: {w}", file=sys.stderr)
        with watchdog.guard("setup"):
            mesh = build_mesh(plan, device)
            set_group_timeouts(args.timeout)
            exe = build_executable(plan, mf, spec, mesh, seed=args.seed, lr=args.lr, loss_fn=mf.loss_fn)
            set_group_timeouts(args.timeout)
        if log:
            for note in exe.notes:
                log(f"note: {note}")
        decision = resume_decision(args.checkpoint_dir, args.resume)
        start, history, seed = 0, [], args.seed
        if decision.path is not None:
            with watchdog.guard(f"resume from {decision.path}"):
                meta, notes = load(exe, decision.path)
            start, history, seed = meta.step, list(meta.losses), meta.seed
            if log:
                log(f"resumed from {decision.path} ({decision.reason}): {start} steps done")
                for n in notes + ([f"data seed {seed} from the checkpoint (not --seed {args.seed})"] if seed != args.seed else []):
                    log(f"note: {n}")
        ck = None
        if args.checkpoint_dir is not None:
            ck = Checkpointer(directory=Path(args.checkpoint_dir), every=args.checkpoint_every, keep=args.keep_checkpoints,
                              seed=seed, lr=args.lr)

        def after_step(done: int, loss: float) -> None:
            history.append(loss)
            if ck is not None and ck.due(done, args.steps):
                path = ck.save(exe, done, history)
                if log:
                    log(f"checkpoint {path}")

        tracer = make_tracer(args.trace, rank, all_ranks=args.trace_all_ranks, steps_to_run=args.steps - start,
                             trace_steps=args.trace_steps)
        hooks = StepHooks(before_step=lambda s: inject_fault(s, rank), after_step=after_step, guard=watchdog.guard,
                          profile_step=tracer.step if tracer else None)
        if log and start == 0:
            hint = initial_loss_hint(mf)
            if hint:
                log(f"note: {hint}")
        if log and start >= args.steps:
            log(f"the checkpoint already has {start} >= --steps {args.steps} steps; nothing to train")
        result = train(exe, mf, steps=args.steps, seed=seed, log=log, start_step=start, hooks=hooks)
        if tracer is not None:
            if tracer.close() and log:
                log(f"trace written to {tracer.path}")
            tracer = None
        if rank0:
            report = build_report(plan, str(mf.path), result, world, args, warnings)
            report["start_step"] = result.start_step
            report["resumed_from"] = str(decision.path) if decision.path else None
            report["loss_history"] = list(history) if args.checkpoint_dir else list(result.losses)
            print(format_comparison(report), flush=True)
            if args.report:
                from autopar.plan import write_text_atomic

                write_text_atomic(args.report, json.dumps(report, indent=2) + "\n")
        with watchdog.guard("final barrier"):
            dist.barrier()
    except AutoparError:
        raise
    finally:
        watchdog.stop()
        if tracer is not None:
            tracer.close()
        dist.destroy_process_group()
    return 0


def initial_loss_hint(mf) -> str | None:  # noqa: ANN001
    """For a next-token model (token ids in, loss_fn numerically mean next-token cross-entropy, a
    ``config.vocab_size``): the loss an untrained model starts near, ln(vocab), so a user can tell
    it trains. None for any other model, or when it cannot be told cheaply."""
    import math

    import torch

    from autopar.executor.context_parallel import is_next_token_loss

    if mf.loss_fn is None:
        return None
    try:
        tokens = mf.example_inputs(1, "cpu")
        if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and not tokens.is_floating_point()):
            return None
        vocab = getattr(getattr(mf.build("meta"), "config", None), "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 2:
            return None
        if not is_next_token_loss(mf.loss_fn, tokens[:, :64], vocab):
            return None
    except Exception:  # noqa: BLE001 - a hint only: never fail a run over it
        return None
    return (f"next-token model, vocabulary {vocab:,}: step 1's loss should be near ln({vocab:,}) = "
            f"{math.log(vocab):.3f} (an untrained model guesses uniformly); falling below it means it trains")
