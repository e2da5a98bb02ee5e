"""What the command modules share: argparse value types, the checks of shared options, and the
warning line."""

from __future__ import annotations

import argparse
import sys

from autopar.errors import AutoparError


def int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, e.g. ``1,2,4``."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


MAX_GPUS = 2**20  # above the largest clusters built (about 10^5 GPUs); the search's work grows with the count


def gpu_counts(text: str) -> tuple[int, ...]:
    """``int_list`` of GPU counts, each at most ``MAX_GPUS``."""
    values = int_list(text)
    if max(values) > MAX_GPUS:
        raise argparse.ArgumentTypeError(f"autopar plans for at most {MAX_GPUS:,} GPUs, got {max(values):,}")
    return values


def positive_int(text: str) -> int:
    """One positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def check_moe_imbalance(value: float) -> None:
    """``--moe-imbalance`` (plan, estimate, explain): the busiest expert-parallel rank's token load
    over the mean, 1 (balanced routing) to 64."""
    if not 1.0 <= value <= 64.0:
        raise AutoparError(f"--moe-imbalance must be in [1, 64] (1 = balanced routing), got {value}")


def warn(message: str) -> None:
    """A warning, one line on stderr (``autopar.api``'s ``warn``, as the commands print it)."""
    print(f"autopar: warning: {message}", file=sys.stderr, flush=True)
