"""What ``autopar run`` asks of every rank: the options ``autopar run`` validated (commands/run.py), as one frozen value.

``rank_main.run_rank`` receives this, not the argparse namespace, so the executor's entry point has
a typed contract (the launcher, a test or a notebook can build one without a parser). The checks
are the command's own: each names the flag to change.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from autopar.errors import AutoparError

DEFAULT_STEPS, DEFAULT_LR, DEFAULT_SEED = 3, 1e-3, 0
DEFAULT_MAX_LOSS_RATIO = 10.0  # a loss 10x its first step's has diverged (--lr 30 took 5 to 16,343)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """One ``autopar run``: what to train, for how long, and where results and checkpoints go."""

    plan_path: str
    steps: int = DEFAULT_STEPS  # total optimizer steps, also when resuming
    lr: float = DEFAULT_LR
    seed: int = DEFAULT_SEED
    timeout_s: float = 600.0  # collective timeout, and the limit of each call into the model file
    report_path: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only after the last step
    keep_checkpoints: int = 2  # 0 keeps all
    resume: bool = False
    trace_path: str | None = None
    trace_steps: int = 2
    trace_all_ranks: bool = False
    # divergence: a step's loss above this times the run's first loss stops the run (0: never)
    max_loss_ratio: float = DEFAULT_MAX_LOSS_RATIO
    # AdaScale (executor/runtime/adascale.py): the learning rate times the gain ratio; with a target, train
    # until the scale-invariant step counter reaches it (instead of --steps)
    adascale: bool = False
    adascale_target: float | None = None
    adascale_force: bool = False  # Adam(W): AdaScale is not validated for it; run it anyway
    # each parameter's first-step gradient norm in the report (executor/runtime/grad_digest.py)
    grad_norms: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise AutoparError(f"--steps must be >= 1, got {self.steps}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise AutoparError(f"--lr must be a positive number, got {self.lr}")
        if not (math.isfinite(self.max_loss_ratio) and (self.max_loss_ratio == 0 or self.max_loss_ratio > 1)):
            raise AutoparError(f"--max-loss-ratio must be 0 (never stop) or a number above 1, got {self.max_loss_ratio}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise AutoparError(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        for flag, value, low in (("--checkpoint-every", self.checkpoint_every, 0),
                                 ("--keep-checkpoints", self.keep_checkpoints, 0), ("--trace-steps", self.trace_steps, 1)):
            if value < low:
                raise AutoparError(f"{flag} must be >= {low}, got {value}")
        self._check_adascale()
        if self.grad_norms and self.report_path is None:
            raise AutoparError("--grad-norms writes into the JSON report: add --report PATH")
        if self.checkpoint_dir is None:
            for flag, on in (("--resume", self.resume), ("--checkpoint-every", self.checkpoint_every > 0)):
                if on:
                    raise AutoparError(f"{flag} needs --checkpoint-dir DIR")

    def _check_adascale(self) -> None:
        if self.adascale_target is not None and not (math.isfinite(self.adascale_target) and self.adascale_target > 0):
            raise AutoparError(f"--adascale-target must be a positive number of scale-invariant steps, got "
                               f"{self.adascale_target}")
        for flag, on in (("--adascale-target", self.adascale_target is not None), ("--adascale-force", self.adascale_force)):
            if on and not self.adascale:
                raise AutoparError(f"{flag} needs --adascale")
        if self.adascale and (self.resume or self.checkpoint_dir is not None):
            raise AutoparError("--adascale does not checkpoint its state (the gain's averages, the scale-invariant "
                               "step counter) yet; run it without --checkpoint-dir and --resume")

    @property
    def step_limit(self) -> int:
        """The most optimizer steps to run: --steps, or with --adascale-target that many (a gain of at
        least 1 reaches the target in at most as many steps)."""
        return math.ceil(self.adascale_target) if self.adascale_target is not None else self.steps

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        """The options of ``autopar run``'s parsed arguments (commands/run.add_arguments)."""
        return cls(plan_path=args.plan, steps=args.steps, lr=args.lr, seed=args.seed,
                   timeout_s=args.timeout, report_path=args.report, checkpoint_dir=args.checkpoint_dir,
                   checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints, resume=args.resume,
                   trace_path=args.trace, trace_steps=args.trace_steps, trace_all_ranks=args.trace_all_ranks,
                   max_loss_ratio=args.max_loss_ratio, adascale=getattr(args, "adascale", False),
                   adascale_target=getattr(args, "adascale_target", None),
                   adascale_force=getattr(args, "adascale_force", False), grad_norms=getattr(args, "grad_norms", False))
