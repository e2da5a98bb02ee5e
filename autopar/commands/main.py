"""autopar's command line: parses argv, hands the arguments to the command's module and turns what
it raises into an exit code and one line on stderr (``run_command``, the only place that does).

Each command is a module ``autopar/commands/<verb>.py`` (``COMMANDS``) that prints its own output; below them,
library code prints only where a user must see it as it happens: warnings on stderr, the log of
``autopar run``'s rank 0 and of the local launcher (launch/local.py).

Exit codes (autopar.errors): 0 success; 2 bad input, including a request no plan can meet ("no plan
fits ...": a one-line ``autopar: error: ...`` on stderr, nothing written); 4 a rank died or a
collective hung during ``autopar run`` (autopar.executor.runtime.faults, autopar.launch.local); 128 + signal
when interrupted (130 SIGINT, 143 SIGTERM); 1 an internal error (a bug: please report it). The whole
contract: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
from typing import Callable, Sequence

from autopar.commands import estimate, explain, export, launch, plan, profile, profiles, rehearse, run, validate
from autopar.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_SIGNAL, EXIT_USAGE, AutoparError
from autopar.version import __version__


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what is wrong and where to look), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# Every command: (name, module, help, description). A command is one module of this package, with
# ``add_arguments(parser)`` and ``main(args) -> exit code``; its module is imported with this one
# (statically, so the import checks see the top of the house), its heavy imports only inside ``main``.
COMMANDS = (
    ("estimate", estimate, "predict step time, MFU and memory of a plan",
     "Predict the step time, tokens/s, MFU and per-GPU memory of PLAN for MODEL. "
     "PLAN.yaml MODEL.py (the order of run, validate and explain) is accepted too."),
    ("profiles", profiles, "list the cluster profiles with their key figures",
     "List shipped and local cluster profiles (./profiles, $AUTOPAR_PROFILES)."),
    ("plan", plan, "search the fastest plan that fits memory",
     "Search (branch and bound, exact stage-split ILP) for the fastest plan of MODEL on N GPUs and write it "
     "as plan YAML v1; lists in --gpus/--global-batch/--seq-len sweep, --tp/--pp/... constrain."),
    ("run", run, "train with a plan (torch.distributed)",
     "Apply PLAN to the model and train for a few steps; report measured vs predicted."),
    ("profile", profile, "measure per-layer compute/memory or collectives",
     "Measure per-layer times and memory on the local device, or collectives under torchrun (--comm)."),
    ("validate", validate, "run a plan briefly and compare with its prediction",
     "Run PLAN for a few steps and print predicted vs measured step time and peak memory per rank."),
    ("rehearse", rehearse, "apply a plan at full scale on fake GPUs and measure each rank's memory",
     "Apply PLAN with the real executor to chosen ranks at its full world size, on fake tensors over a fake "
     "process group (one CPU process per rank, no GPU), run one training step each under torch's memory "
     "tracker, and print each rank's measured peak beside the cost model's prediction."),
    ("explain", explain, "show a plan's mesh, stages, memory and communication",
     "Explain PLAN: rank groups per mesh axis, layers per stage, memory and communication per step."),
    ("export", export, "write a plan as Megatron-LM flags, a torchtitan TOML, a DeepSpeed JSON or an accelerate config",
     "Write PLAN in an engine's own configuration format (--to megatron|torchtitan|deepspeed|accelerate). A plan "
     "feature the engine cannot express is an error naming it and 'autopar plan --engine ENGINE'. "
     "'autopar estimate MODEL.py --from ENGINE FILE' reads the file back."),
    ("launch", launch, "print the torchrun lines or an sbatch script for a plan",
     "Print the per-node torchrun command lines (or a Slurm sbatch script) that run PLAN."),
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser: every command of ``COMMANDS``."""
    parser = _Parser(prog="autopar", description="Plan and run hybrid-parallel PyTorch training.",
                     epilog="exit codes: 0 ok, 2 bad input or no plan fits memory, 3 a rank ran out of device memory, "
                            "4 a rank died or hung, 130/143 interrupted, 1 internal error (docs/reliability.md)")
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, module, help_text, description in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=description)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from autopar.usercode import configure

    parser = build_parser()
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread() and "LOCAL_RANK" not in os.environ:
        # exit 143 and one line; a rank (LOCAL_RANK: torchrun's or the launcher's) keeps SIGTERM's
        # default, so a launcher stopping it is obeyed inside a collective too
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGINT, _on_sigint)
    configure(hard_exit=True)  # a model-file call that ignores its time limit ends the process (usercode.py)
    return run_command(args.func, args)


def run_command(command: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """``command(args)``'s exit code: what it returns, else the exit code of what it raised, with
    one line on stderr (an ``AutoparError``'s own code; Ctrl-C 130; a closed stdout pipe, as in
    ``autopar plan ... | head``, 0). Anything else escapes: a bug, Python's traceback and exit 1."""
    try:
        return int(command(args) or 0)
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated:
        print("autopar: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_SIGNAL + signal.SIGTERM
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK
    except OSError as exc:  # the file system said no: name why, and what to change
        print(f"autopar: error: {os_error_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is (``main`` installs the handler): what cleans up on
    Ctrl-C (temporary files, a forked solver) cleans up here too, and the exit code is 143."""


def _on_sigterm(signum: int, frame: object) -> None:
    if not _deferred_in_import(signum, frame):
        raise Terminated()


def _on_sigint(signum: int, frame: object) -> None:
    if not _deferred_in_import(signum, frame):
        raise KeyboardInterrupt()


# How soon a signal that arrived during an import is delivered again.
SIGNAL_RETRY_S = 0.05


def _deferred_in_import(signum: int, frame: object) -> bool:
    """Whether the signal arrived while a module is being imported, in which case it is sent again
    shortly instead of raising now. An exception raised inside an import can be swallowed by an
    extension's initialisation: torch._C imports NumPy from C++ and treats any failure as NumPy being
    absent, so a Ctrl-C or SIGTERM during ``import torch`` left a half-initialised NumPy behind and
    the command failed later with a traceback instead of exiting 130 / 143."""
    while frame is not None:
        if getattr(frame, "f_code", None) is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
            timer = threading.Timer(SIGNAL_RETRY_S, os.kill, (os.getpid(), signum))
            timer.daemon = True
            timer.start()
            return True
        frame = frame.f_back
    return False


# errno -> what to change (the error's own text names the cause)
_OS_HINTS = {errno.ENAMETOOLONG: "use a shorter path (at most 255 characters a name)",
             errno.ENOSPC: "free space there or write elsewhere",
             errno.EDQUOT: "free space there or write elsewhere",
             errno.EROFS: "write to a writable location",
             errno.EACCES: "check its permissions", errno.EPERM: "check its permissions",
             errno.ENOENT: "check the path", errno.ENOTDIR: "check the path",
             errno.EISDIR: "give a file, not a directory"}


def os_error_line(exc: OSError) -> str:
    """One line for an OSError: its cause, the path (shortened past 80 characters) and what to change."""
    name = exc.filename if exc.filename is not None else ""
    path = str(name)
    if len(path) > 80:
        path = f"{path[:40]}...{path[-30:]} ({len(path):,} characters)"
    line = exc.strerror or type(exc).__name__
    if path:
        line += f": {path}"
    hint = _OS_HINTS.get(exc.errno or 0)
    return f"{line}; {hint}" if hint else line


def exit_process(code: int) -> None:
    """Exit with ``code``. Where this process ran a rank -- under torchrun (``TORCHELASTIC_RUN_ID``)
    or a one-rank run in the calling process (``AUTOPAR_LOCAL_WORLD``) -- once the command has
    returned (process group destroyed, reports written) it leaves with ``os._exit`` after flushing
    its streams: at interpreter teardown a native thread of the distributed stack was, now and
    then, destroyed while still joinable ("terminate called without an active exception", a SIGABRT
    after the command had finished: about 1 CPU run in 20 here), which made torchrun report a failed
    job and turned a one-rank run's exit code 3 into -6. Elsewhere: a normal exit."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and os.environ.get("AUTOPAR_LOCAL_WORLD") != "1":
        raise SystemExit(code)
    leave_process(code)


def entry() -> None:
    """The ``autopar`` console script: ``main`` then ``exit_process``."""
    exit_process(main())


def leave_process(code: int) -> None:
    """Flush stdout and stderr and leave with ``os._exit(code)``, skipping the interpreter's
    teardown (``exit_process``; the distributed tests' spawned ranks call it too)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
