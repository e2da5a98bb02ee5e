"""The error family autopar raises for user mistakes, and the exit codes of every command.

Every user-facing failure is an ``AutoparError`` whose message is one line that says what is wrong
and what to change. The CLI prints it as ``autopar: error: <message>`` and exits with the error's
``exit_code`` (autopar/commands/main.py, the one place errors become exit codes); anything else
escaping is a bug in autopar, not in the user's input.

The exit codes are a contract (docs/reliability.md, "The failure contract"), defined here once.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_INTERNAL = 1  # an internal error, a bug: Python's own code for an uncaught exception
EXIT_USAGE = 2  # bad input, including a request no plan can meet
EXIT_OUT_OF_MEMORY = 3  # autopar run: a rank ran out of device memory
EXIT_FAULT = 4  # a rank died or a collective hung (autopar run, validate, profile --comm)
EXIT_SIGNAL = 128  # interrupted by a signal: 128 + its number (130 SIGINT, 143 SIGTERM)
EXIT_INTERRUPTED = EXIT_SIGNAL + signal.SIGINT  # Ctrl-C


class AutoparError(ValueError):
    """A user error: bad input, an impossible request, or a model that cannot be planned."""

    exit_code: int = EXIT_USAGE

    def __init__(self, message: str) -> None:
        # One line only: multi-line messages break the "one-line error" promise of the CLI.
        super().__init__(" ".join(str(message).split()))


class PlanError(AutoparError):
    """A plan file or plan value is malformed or impossible."""


class ModelFileError(AutoparError):
    """A user's model file cannot be imported, built on meta, or called."""


class ClusterError(AutoparError):
    """A cluster profile is missing or malformed."""


class OutOfDeviceMemory(AutoparError):
    """A rank of ``autopar run`` ran out of device memory: the plan needs more than the device has
    (exit 3; the message says what the plan was priced at and what to change)."""

    exit_code = EXIT_OUT_OF_MEMORY


class InfeasibleError(AutoparError):
    """No plan fits the device memory (or no legal plan exists). Like every input the user can
    change (more GPUs, a larger-memory GPU, a shorter sequence), it exits with code 2; the message
    starts "no plan fits" so scripts can tell it apart."""
