"""The error family autopar raises for user mistakes.

Every user-facing failure is an ``AutoparError`` whose message is one line that says what is wrong
and what to change. The CLI prints it as ``autopar: error: <message>`` and exits with code 2;
anything else escaping is a bug in autopar, not in the user's input.
"""

from __future__ import annotations


class AutoparError(ValueError):
    """A user error: bad input, an impossible request, or a model that cannot be planned."""

    exit_code: int = 2

    def __init__(self, message: str) -> None:
        # One line only: multi-line messages break the "one-line error" promise of the CLI.
        super().__init__(" ".join(str(message).split()))


class PlanError(AutoparError):
    """A plan file or plan value is malformed or impossible."""


class ModelFileError(AutoparError):
    """A user's model file cannot be imported, built on meta, or called."""


class ClusterError(AutoparError):
    """A cluster profile is missing or malformed."""


class InfeasibleError(AutoparError):
    """No plan fits the device memory (or no legal plan exists). Like every input the user can
    change (more GPUs, a larger-memory GPU, a shorter sequence), it exits with code 2; the message
    starts "no plan fits" so scripts can tell it apart."""
