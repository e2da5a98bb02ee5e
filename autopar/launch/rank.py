"""The rank side of autopar's local launcher (autopar.launch.local): what a process started as one
rank of ``run_local`` -- or of torchrun -- does to join its job and to be seen by the launcher.

* ``arm_parent_death_signal``: first thing, die with the launcher (``PR_SET_PDEATHSIG``).
* ``join_process_group``: ``init_process_group`` on the launcher's loopback TCPStore (rank 0 serves
  it on the socket the launcher bound, ``AUTOPAR_STORE_FD``), an in-process store for a world of
  one, torchrun's env:// rendezvous under torchrun.
* ``write_status``: the rank's current phase, where the launcher reads it after a death.

The launcher and its ranks share only the environment contract (module docstring of
autopar.launch.local); nothing here starts or watches processes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

from autopar.errors import EXIT_FAULT

_PR_SET_PDEATHSIG = 1


def arm_parent_death_signal() -> None:
    """Rank side, first thing: die with the launcher (``PR_SET_PDEATHSIG``, Linux). Done in the rank
    rather than in a ``preexec_fn`` (not safe in a launcher that runs threads); a launcher that died
    before this ran is caught by comparing the parent pid with ``AUTOPAR_LAUNCHER_PID``."""
    launcher = os.environ.get("AUTOPAR_LAUNCHER_PID")
    if not launcher or sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):
        os._exit(EXIT_FAULT)


def process_group_options(backend: str) -> dict:
    """Extra ``init_process_group`` arguments: on NCCL the rank's device (``device_id``), so the
    communicator starts at once -- a peer missing at start-up fails the join, within --timeout,
    not the first collective -- and DeviceMesh's sub-groups split it (ncclCommSplit)."""
    if backend != "nccl":
        return {}
    import torch

    return {"device_id": torch.device("cuda", torch.cuda.current_device())}


def under_launcher() -> bool:
    """Whether this process is one rank of a job (this launcher's or torchrun's)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def join_process_group(backend: str, timeout: timedelta) -> None:
    """Rank side: ``init_process_group`` for a rank of ``run_local`` -- rank 0 serves the TCPStore
    on the socket the launcher bound to 127.0.0.1 (``AUTOPAR_STORE_FD``), the others connect to it;
    a world of one without a launcher (or with ``AUTOPAR_LOCAL_WORLD=1``) uses an in-process
    HashStore -- and the default env:// rendezvous under torchrun. Nothing of ours listens beyond
    loopback."""
    import torch.distributed as dist

    ours = os.environ.get("AUTOPAR_LOOPBACK_STORE") == "1" or os.environ.get("AUTOPAR_LOCAL_WORLD") == "1"
    options = process_group_options(backend)
    if not ours and under_launcher():
        dist.init_process_group(backend, timeout=timeout, **options)
        return
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "AUTOPAR_STORE_FD" not in os.environ:
        store = dist.HashStore()
    elif rank == 0:
        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, True, timeout,
                              master_listen_fd=int(os.environ["AUTOPAR_STORE_FD"]), use_libuv=False)
    else:
        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, False, timeout, use_libuv=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **options)


def write_status(phase: str) -> None:
    """Rank side: record this rank's current phase where the launcher reads it after a death
    (``AUTOPAR_STATUS_DIR``; a no-op elsewhere). Atomic (temp + rename), a few bytes per phase."""
    d = os.environ.get("AUTOPAR_STATUS_DIR")
    rank = os.environ.get("RANK")
    if not d or rank is None:
        return
    path = Path(d) / f"rank{rank}"
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(phase + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
