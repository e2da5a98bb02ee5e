"""One bring-up of a plan on this rank: preflight -> join the process group -> mesh -> executable.

Every path that applies a plan on a rank goes through ``start``: ``autopar run``'s ranks
(rank_main.py), ``autopar validate``'s ranks (commands/validate.py), the library's ``apply_plan``
(api.py) and the benchmarks. What differs between them is an explicit option of ``StartOptions``
and ``Join``, never a copy of the sequence:

* whether ``start`` joins the process group (``Join``) or finds it up already (a library user's
  ``init_process_group``, a benchmark's gloo group, a rehearsal's fake group);
* how it joins: autopar's launcher store only (``validate``), or that plus torchrun restarts with a
  flight recorder and a one-line exit on failure (``run``);
* whether the caller already ran preflight (the commands do, before any rank starts, so its error
  comes before any other);
* the device, the seed, the learning rate and the loss;
* a guard around the collective part of the build (``run``'s watchdog) and per-group timeouts.
"""

from __future__ import annotations

import os
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

from autopar.errors import EXIT_FAULT, EXIT_USAGE, AutoparError

if TYPE_CHECKING:
    import torch

    from autopar.executor.parallel.apply import Executable
    from autopar.modelfile import ModelFile
    from autopar.plan import Plan
    from autopar.spec import ModelSpec

# The exit codes of a rank that leaves at once (``Join.exit_on_failure``): a peer that never arrived
# is a fault (4, the launcher may restart the job); ranks that hold different models is a user
# error (2).
EXIT_JOIN_FAILED = EXIT_FAULT
EXIT_OTHER_MODEL = EXIT_USAGE


@dataclass(frozen=True, kw_only=True)
class Join:
    """How ``start`` joins the default process group (the backend follows the device: NCCL on
    CUDA, gloo on CPU).

    ``timeout_s``: the group's timeout and how long a rank waits for its peers.
    ``restartable``: ``autopar run``'s join -- the collective flight recorder on, and under a
    torchrun agent store keys private to each restart attempt; otherwise autopar's launcher store
    (or env:// under torchrun, an in-process store for a world of one), as ``validate`` joins.
    ``check_same_model``: once joined (world > 1), every rank compares its model's structure.
    ``exit_on_failure``: a rank that cannot join, or holds another model than its peers, prints
    one line and leaves the process at once (exit 4, 2) -- a peer may be dead, so no collective
    or teardown may run; otherwise the error propagates.
    """

    timeout_s: float
    restartable: bool = False
    check_same_model: bool = False
    exit_on_failure: bool = False


@dataclass(frozen=True, kw_only=True)
class StartOptions:
    """The options of one ``start``; the defaults are a library user's ``apply_plan``.

    ``seed``/``lr``: the weights (``torch.manual_seed(seed); build_model()``) and the optimizer.
    ``loss_fn``: None takes the model file's. ``device``: None is this rank's (``device_for_rank``).
    ``spec``: the model spec of a preflight the caller already ran; None runs it here, at the
    process group's world size. ``join``: None when the process group is up already.
    ``after_join``: called once the group is up, before the mesh (the run command makes its
    watchdog there, the validate command measures its baseline memory).
    ``guard``: a context manager factory wrapping the mesh and the build, entered as
    ``guard("setup")``. ``group_timeout_s``: re-applied to every process group after the mesh and
    again after the build (they create groups of their own).
    """

    seed: int = 0
    lr: float = 1e-3
    loss_fn: Callable[..., Any] | None = None
    device: torch.device | None = None
    spec: ModelSpec | None = None
    join: Join | None = None
    after_join: Callable[[], None] | None = None
    guard: Callable[[str], AbstractContextManager[Any]] | None = None
    group_timeout_s: float | None = None


def start(plan: Plan, mf: ModelFile, options: StartOptions) -> Executable:
    """Bring ``plan`` up on this rank and return its ``Executable``; collective over the plan's world.

    In this order: (1) preflight (``checks.preflight``) unless ``options.spec`` is given;
    (2) join the default process group when ``options.join`` asks (then the same-model check);
    (3) ``options.after_join``; (4) under ``options.guard("setup")``: the device mesh
    (``mesh.build_mesh``), the group timeouts, the executable (``apply.build_executable``), the
    group timeouts again.

    Errors: preflight's one-line ``AutoparError``; ``AutoparError`` when there is neither a
    process group nor a ``Join``, or a ``Join`` without the caller's ``spec`` (the commands
    preflight before any rank starts); a failure to join (or another model on a peer) raises, or
    with ``Join.exit_on_failure`` exits the process (4, 2); the mesh's and the build's errors
    (``AutoparError``, ``torch.OutOfMemoryError``, a distributed error) propagate, so the caller
    names the phase. ``start`` never destroys the process group: the caller that owns it does.
    """
    import torch.distributed as dist

    from autopar.executor.parallel.apply import build_executable
    from autopar.executor.parallel.mesh import backend_for, build_mesh, device_for_rank

    device = options.device if options.device is not None else device_for_rank()
    spec = options.spec
    if options.join is not None and spec is None:
        raise AutoparError("start: a caller that joins the process group passes the spec of its own preflight")
    if options.join is None and not (dist.is_available() and dist.is_initialized()):
        raise AutoparError("start: no process group is initialised and no Join was asked for")
    if spec is None:
        from autopar.executor.runtime.checks import preflight

        spec, _warnings = preflight(plan, mf, dist.get_world_size())
    if options.join is not None:
        _join(options.join, device, mf, backend_for(device))
    if options.after_join is not None:
        options.after_join()
    guard = options.guard or (lambda _phase: nullcontext())
    with guard("setup"):
        mesh = build_mesh(plan, device)
        _set_group_timeouts(options.group_timeout_s)
        exe = build_executable(plan, mf, spec, mesh, seed=options.seed, lr=options.lr,
                               loss_fn=options.loss_fn or mf.loss_fn)
        _set_group_timeouts(options.group_timeout_s)
    return exe


def _set_group_timeouts(seconds: float | None) -> None:
    if seconds is not None:
        from autopar.executor.runtime.faults import set_group_timeouts

        set_group_timeouts(seconds)


def _join(join: Join, device: torch.device, mf: ModelFile, backend: str) -> None:
    """Step (2) of ``start``: join, then (world > 1, when asked) check that every rank holds the same model."""
    import torch.distributed as dist

    timeout = timedelta(seconds=join.timeout_s)
    if not join.restartable:
        from autopar.launch.rank import join_process_group

        join_process_group(backend, timeout)
    else:
        from autopar.executor.runtime.faults import enable_flight_recorder

        enable_flight_recorder()
        try:
            _init_restartable(backend, timeout)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - a peer that never arrived: a fault, not a bug
            if not join.exit_on_failure:
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            die_with(f"rank {os.environ.get('RANK', '0')} could not join the process group within --timeout "
                     f"{join.timeout_s:g} s ({first}); another rank died or hung at start-up (see its log)",
                     EXIT_JOIN_FAILED)
    if join.check_same_model and dist.get_world_size() > 1:
        from autopar.executor.runtime.same_model import check_same_model

        different = check_same_model(mf.build("meta"), device)
        if different:
            if join.exit_on_failure:
                die_with(different, EXIT_OTHER_MODEL)
            raise AutoparError(different)


def _init_restartable(backend: str, timeout: timedelta) -> None:
    """init_process_group; under a torchrun agent store, with keys private to this restart attempt.

    torchrun (c10d rendezvous, torch 2.13) hands every attempt the same agent TCPStore without a
    per-attempt prefix, so after a restart gloo would read the dead attempt's peer addresses and
    fail to connect ("Connection refused"). A PrefixStore per TORCHELASTIC_RESTART_COUNT avoids it.
    Under autopar's own launcher (or a world of one), its loopback store (launch/rank.py): nothing
    listens beyond loopback.
    """
    import torch.distributed as dist

    from autopar.launch.rank import join_process_group, process_group_options

    if os.environ.get("AUTOPAR_LOOPBACK_STORE") == "1" or os.environ.get("AUTOPAR_LOCAL_WORLD") == "1":
        join_process_group(backend, timeout)
        return
    options = process_group_options(backend)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, **options)
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"/autopar/attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout, **options)


def die_with(line: str, code: int) -> None:
    """Print the one-line error and leave now: with a peer dead or stopped, destroying the process
    group (or any other collective) could block forever, and the launcher is waiting for the line."""
    print(f"autopar: error: {line}", file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)
