"""Start-up faults of the launch environment, named before any rank starts.

A rank learns its place from torchrun's environment contract: ``RANK`` and ``WORLD_SIZE``, and the
rendezvous address ``MASTER_ADDR``:``MASTER_PORT`` (torchrun sets all four; autopar's own launcher,
``--nproc-per-node``, sets them for the ranks it starts). A shell with some of them left over from
an earlier job, or a hand-made launch missing one, otherwise ends in a rendezvous that never
completes -- reported, after the timeout, as a rank that died or hung (exit 4). ``environment_fault``
says instead, in one line, what to change (exit 2).
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Mapping

RANK_VARS = ("RANK", "WORLD_SIZE")
ADDRESS_VARS = ("MASTER_ADDR", "MASTER_PORT")


def _own_rank(environ: Mapping[str, str]) -> bool:
    """A rank that autopar's launcher started (launch/local.py ``rank_env``)."""
    return environ.get("AUTOPAR_LOOPBACK_STORE") == "1" and "AUTOPAR_LAUNCHER_PID" in environ


def _int(environ: Mapping[str, str], var: str) -> int | None:
    try:
        return int(environ[var])
    except (KeyError, ValueError):
        return None


def environment_fault(environ: Mapping[str, str], nproc_per_node: int | None) -> str | None:
    """What is wrong with the launch environment ``environ`` of a command given ``--nproc-per-node``
    ``nproc_per_node`` (None: not given), as one line; None when nothing is."""
    if _own_rank(environ):
        return None
    present = [v for v in RANK_VARS if v in environ]
    shown = " and ".join(f"{v}={environ[v]}" for v in present)
    if nproc_per_node is not None:
        if present:
            return (f"{shown} {'is' if len(present) == 1 else 'are'} set in the environment, as torchrun sets "
                    f"them for its ranks, but --nproc-per-node starts the ranks itself; unset "
                    f"{' '.join(present)} (e.g. `unset {' '.join(present)}`), or drop --nproc-per-node under torchrun")
        return None
    if not present:
        return None
    if len(present) == 1:
        missing = "WORLD_SIZE" if present == ["RANK"] else "RANK"
        if missing == "RANK" and _int(environ, "WORLD_SIZE") == 1:
            return None  # a lone WORLD_SIZE=1 means what it says
        return (f"{shown} is set in the environment but {missing} is not; start the ranks with torchrun "
                f"(which sets both), or unset {present[0]} and use --nproc-per-node")
    rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    if world is None or world < 1:
        return f"WORLD_SIZE={environ['WORLD_SIZE']} in the environment is not a positive integer; fix or unset it"
    if rank is None or not 0 <= rank < world:
        return (f"RANK={environ['RANK']} in the environment is not an integer from 0 to WORLD_SIZE - 1 = {world - 1}; "
                "fix or unset it")
    if world == 1:
        return None  # a world of one needs no rendezvous
    missing = [v for v in ADDRESS_VARS if not environ.get(v)]
    if missing:
        return (f"{shown} are set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not, so the "
                "ranks have no address to meet at; start them with torchrun (which sets all four), or unset "
                "RANK and WORLD_SIZE and use --nproc-per-node")
    port = _int(environ, "MASTER_PORT")
    if port is None or not 1 <= port <= 65535:
        return f"MASTER_PORT={environ['MASTER_PORT']} in the environment is not a port number (1-65535); fix it"
    if rank == 0 and "TORCHELASTIC_RUN_ID" not in environ:
        # a hand-made launch (no torchrun agent, which owns its ports): rank 0 serves the env://
        # rendezvous store on MASTER_PORT
        busy = port_in_use(environ["MASTER_ADDR"], port)
        if busy:
            return (f"MASTER_PORT={port} is already in use on {environ['MASTER_ADDR']} (another job, or a rank of "
                    "an earlier run still alive), so rank 0 cannot serve the rendezvous there; pick a free port "
                    "or stop that process")
    return None


def check_environment(nproc_per_node: int | None) -> None:
    """Raise the one-line ``AutoparError`` of ``environment_fault`` for this process's environment:
    the start of a command that starts or joins ranks (``run``, ``validate``), before any rank starts."""
    from autopar.errors import AutoparError

    fault = environment_fault(os.environ, nproc_per_node)
    if fault:
        raise AutoparError(fault)


def port_in_use(address: str, port: int) -> bool:
    """Whether ``port`` on ``address`` is taken on this host: a bind that fails with EADDRINUSE. An
    address that is not this host's (EADDRNOTAVAIL, or one that does not resolve) is not checked."""
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, where in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(where)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            continue
    return False
