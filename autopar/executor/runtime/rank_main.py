"""What every rank of ``autopar run`` does once the arguments are validated (commands/run.py).

The bring-up (start.py: init_process_group with the flight recorder on, the same-model check,
mesh, executable, per-group timeouts, under the watchdog) -> resume
(``--resume``, or automatically after a torchrun restart) -> train with checkpoint / trace / fault
hooks -> report (rank 0) -> destroy_process_group (always).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from autopar.errors import AutoparError, OutOfDeviceMemory
from autopar.executor.runtime.run_options import RunOptions
from autopar.executor.runtime.run_report import build_report, format_comparison
from autopar.executor.runtime.start import die_with


class NonFiniteLoss(AutoparError):
    """A step's loss is NaN or infinite: the run stops (exit 2) and keeps the last good checkpoint."""


class DivergedLoss(AutoparError):
    """A step's loss rose past ``--max-loss-ratio`` times the run's first: the run stops (exit 2)
    and keeps the last good checkpoint."""


def check_divergence(done: int, loss: float, first: float | None, ratio: float, kept: str) -> None:
    """Raise ``DivergedLoss`` when ``loss`` (step ``done``) is above ``ratio`` times ``first``, the
    run's first loss (none, or not positive: nothing to compare); ``ratio`` 0 never stops."""
    if ratio and first is not None and first > 0 and loss > ratio * first:
        raise DivergedLoss(f"the loss of step {done} is {loss:.4g}, more than {ratio:g}x the first step's "
                           f"{first:.4g}: training diverged; it stopped before saving that step and {kept}; lower "
                           f"--lr, or raise --max-loss-ratio (0 never stops)")


@dataclass(frozen=True, kw_only=True)
class ResumeDecision:
    """Where this attempt starts: a checkpoint path, or None (from the seed)."""

    path: Path | None
    reason: str


def resume_decision(checkpoint_dir: str | None, resume: bool, warn=None, gather=None, share: int = 0,  # noqa: ANN001
                    of: int = 1) -> ResumeDecision:
    """``--resume`` or a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest
    *intact* checkpoint in ``checkpoint_dir`` (integrity.choose: damaged newer ones are skipped with
    a warning; none intact is a one-line error); ``--resume`` without any checkpoint is an error
    (found before launch by commands/run.py). ``gather``/``share``/``of``: the ranks share the hashing."""
    from autopar.executor.checkpoint.checkpoint import CheckpointError
    from autopar.executor.checkpoint.integrity import choose
    from autopar.executor.runtime.faults import first_attempt

    if checkpoint_dir is None:
        return ResumeDecision(path=None, reason="no --checkpoint-dir")
    if not resume and first_attempt():
        return ResumeDecision(path=None, reason="fresh start")
    latest = choose(checkpoint_dir, warn=warn, gather=gather, share=share, of=of)
    if latest is None:
        if resume:
            raise CheckpointError(f"--resume: no complete checkpoint in {checkpoint_dir}")
        return ResumeDecision(path=None, reason="fresh start")
    why = "--resume" if resume else f"torchrun restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
    return ResumeDecision(path=latest, reason=why)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(options: RunOptions, plan, mf, spec, warnings: list[str], world: int) -> int:  # noqa: ANN001
    """Run ``plan`` on this rank (module docstring); 0 on success. ``plan``, ``mf`` (the model file)
    and ``spec`` (its model spec) come checked from the run command's preflight; ``warnings`` are printed by rank 0."""
    import torch
    import torch.distributed as dist

    from autopar.executor.checkpoint.checkpoint import Checkpointer, load
    from autopar.executor.parallel.mesh import device_for_rank
    from autopar.executor.runtime.faults import Watchdog, inject_fault, inject_save_fault, poison_loss
    from autopar.executor.runtime.start import Join, StartOptions, start
    from autopar.executor.runtime.tracing import make_tracer
    from autopar.executor.runtime.train import AdaScaleOptions, StepHooks, train
    from autopar.launch.rank import write_status

    device = device_for_rank()
    if world == 1 and "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ["AUTOPAR_LOCAL_WORLD"] = "1"  # in-process store: no listening socket (start.py)
        from autopar.launch.local import loopback_interface

        lo = loopback_interface()
        if lo:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    import warnings as _warnings

    # FSDP2 warns on every wrapped block that returns a view; the executor never mutates outputs.
    _warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    # The watchdog names the rank, so it is made once the group is up (start's after_join), and it
    # guards the collective part of the build.
    watchdogs: list[Watchdog] = []

    def joined() -> None:
        watchdogs.append(Watchdog(dist.get_rank(), limit_s=2 * options.timeout_s + 60, timeout_s=options.timeout_s))
        if dist.get_rank() == 0:
            for w in warnings:
                print(f"autopar: {w}", file=sys.stderr)

    def stop_watchdog() -> None:
        for w in watchdogs:
            w.stop()

    tracer = None
    report_error: str | None = None
    phase = ["setup"]  # where the rank is: named by an out-of-memory error
    try:
        # A rank that cannot join, or holds another model, leaves inside start with one line (4, 2).
        exe = start(plan, mf, StartOptions(
            seed=options.seed, lr=options.lr, device=device, spec=spec,
            join=Join(timeout_s=options.timeout_s, restartable=True, check_same_model=True, exit_on_failure=True),
            after_join=joined, guard=lambda what: watchdogs[0].guard(what), group_timeout_s=options.timeout_s))
        watchdog = watchdogs[0]
        rank = dist.get_rank()
        rank0 = rank == 0
        log = (lambda s: print(f"autopar run: {s}", flush=True)) if rank0 else None
        if log:
            for note in exe.notes:
                log(f"note: {note}")
        def say(line: str) -> None:
            if rank0:
                print(f"autopar: warning: {line}", file=sys.stderr, flush=True)

        def gather(verdict):  # noqa: ANN001, ANN202 - every rank's integrity verdict on its share
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, verdict)
            return every

        with watchdog.guard("checking checkpoints"):
            decision = resume_decision(options.checkpoint_dir, options.resume, warn=say, gather=gather, share=rank,
                                       of=dist.get_world_size())
        start_step, history, seed = 0, [], options.seed
        if decision.path is not None:
            with watchdog.guard(f"resume from {decision.path}"):
                meta, notes = load(exe, decision.path)
            start_step, history, seed = meta.step, list(meta.losses), meta.seed
            if log:
                log(f"resumed from {decision.path} ({decision.reason}): {start_step} steps done")
                for n in notes + ([f"data seed {seed} from the checkpoint (not --seed {options.seed})"] if seed != options.seed else []):
                    log(f"note: {n}")
        ck = None
        if options.checkpoint_dir is not None:
            ck = Checkpointer(directory=Path(options.checkpoint_dir), every=options.checkpoint_every, keep=options.keep_checkpoints,
                              seed=seed, lr=options.lr)

        last_saved: list[Path | None] = [decision.path]

        def after_step(done: int, loss: float) -> None:
            loss = poison_loss(done, loss)
            kept = f"the last good checkpoint {last_saved[0]} is kept" if last_saved[0] else "no checkpoint was written"
            if not math.isfinite(loss):  # every rank holds the same all-reduced loss: all stop here
                raise NonFiniteLoss(f"the loss of step {done} is {loss}; training stopped before saving it and {kept}; "
                                    "lower --lr, or check the model's numerics and data")
            check_divergence(done, loss, history[0] if history else None, options.max_loss_ratio, kept)
            history.append(loss)
            if ck is not None and ck.due(done, options.steps):
                last_saved[0] = ck.save(exe, done, history, before_publish=lambda: inject_save_fault(rank))
                if log:
                    log(f"checkpoint {last_saved[0]}")

        tracer = make_tracer(options.trace_path, rank, all_ranks=options.trace_all_ranks, steps_to_run=options.step_limit - start_step,
                             trace_steps=options.trace_steps)
        def before_step(step: int) -> None:
            phase[0] = f"step {step + 1}"
            write_status(f"step {step + 1}")  # a rank killed between phases is reported at the right step
            inject_fault(step, rank)

        hooks = StepHooks(before_step=before_step, after_step=after_step, guard=watchdog.guard,
                          profile_step=tracer.step if tracer else None)
        if log and start_step == 0:
            hint = initial_loss_hint(mf)
            if hint:
                log(f"note: {hint}")
        if log and start_step >= options.steps:
            log(f"the checkpoint already has {start_step} >= --steps {options.steps} steps; nothing to train")
        adascale = AdaScaleOptions(target_steps=options.adascale_target) if options.adascale else None
        on_grads, grad_norms = None, None
        if options.grad_norms:  # executor/runtime/grad_digest.py
            from autopar.executor.runtime.grad_digest import first_step_grad_norms

            on_grads, grad_norms = first_step_grad_norms(exe, start_step)
        result = train(exe, mf, steps=options.step_limit, seed=seed, log=log, start_step=start_step, hooks=hooks,
                       measure_noise=True, adascale=adascale, on_grads=on_grads)
        if tracer is not None:
            if tracer.close() and log:
                log(f"trace written to {tracer.path}")
            tracer = None
        if rank0:
            report = build_report(plan, str(mf.path), result, world, options, warnings)
            report["start_step"] = result.start_step
            report["resumed_from"] = str(decision.path) if decision.path else None
            report["loss_history"] = list(history) if options.checkpoint_dir else list(result.losses)
            if grad_norms is not None:
                report["grad_norms"] = dict(sorted(grad_norms.items()))
            print(format_comparison(report), flush=True)
            if options.report_path:
                from autopar.outputs import write_text_atomic

                try:  # never leave the other ranks waiting in the barrier for a failed write
                    write_text_atomic(options.report_path, json.dumps(report, indent=2, allow_nan=False) + "\n", "--report")
                except (AutoparError, ValueError) as exc:
                    print(json.dumps(report, indent=2), flush=True)  # not lost: on stdout instead
                    report_error = f"{exc}; the JSON report is printed on stdout instead"
        with watchdog.guard("final barrier"):
            dist.barrier()
        if report_error:
            raise AutoparError(report_error)
    except torch.OutOfMemoryError as exc:
        oom = out_of_memory(dist.get_rank(), phase[0], exc, plan, options.plan_path)
        if world > 1:
            stop_watchdog()
            die_with(str(oom), oom.exit_code)
        raise oom from None
    except AutoparError as exc:
        if world > 1:  # the others may be blocked in a collective: leave now, with the one line
            stop_watchdog()
            die_with(str(exc), exc.exit_code)
        raise
    finally:
        stop_watchdog()
        if tracer is not None:
            tracer.close()
        if dist.is_initialized():  # not when start was interrupted before the group was up
            dist.destroy_process_group()
    return 0


def out_of_memory(rank: int, phase: str, exc: BaseException, plan, plan_path: str) -> OutOfDeviceMemory:  # noqa: ANN001
    """The one line a rank that ran out of device memory ends with: where, torch's own first line,
    what the plan was priced at, and what to change (exit 3)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    pred = (plan.prediction or {}).get("peak_memory_bytes")
    cap = (plan.prediction or {}).get("capacity_bytes")
    priced = (f"; the plan was priced at {pred / 2**30:.1f} of {cap / 2**30:.1f} GiB per GPU" if pred and cap else "")
    return OutOfDeviceMemory(
        f"rank {rank} ran out of device memory in {phase} ({first}){priced}: check the plan with 'autopar rehearse "
        f"{plan_path}', or plan with more GPUs, recompute, or a smaller micro-batch (autopar plan --verify 3)")


def initial_loss_hint(mf) -> str | None:  # noqa: ANN001
    """For a next-token model (token ids in, loss_fn numerically mean next-token cross-entropy, a
    ``config.vocab_size``): the loss an untrained model starts near, ln(vocab), so a user can tell
    it trains. None for any other model, or when it cannot be told cheaply."""
    import torch

    if mf.loss_fn is None:
        return None
    # The model file's code may draw from the global RNG (example_inputs with torch.randint); only
    # the logging rank runs this, so it must leave the RNG as it found it, or the ranks' random
    # streams (dropout, data) part ways.
    with torch.random.fork_rng(devices=[]):
        return _initial_loss_hint(mf)


def _initial_loss_hint(mf) -> str | None:  # noqa: ANN001
    import math

    import torch

    from autopar.executor.parallel.context_parallel import is_next_token_loss

    try:
        tokens = mf.example_inputs(1, "cpu")
        if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and not tokens.is_floating_point()):
            return None
        vocab = getattr(getattr(mf.build("meta"), "config", None), "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 2:
            return None
        if not is_next_token_loss(mf.loss_fn, tokens, vocab):
            return None
    except Exception:  # noqa: BLE001 - a hint only: never fail a run over it
        return None
    return (f"next-token model, vocabulary {vocab:,}: step 1's loss should be near ln({vocab:,}) = "
            f"{math.log(vocab):.3f} (an untrained model guesses uniformly); falling below it means it trains")
