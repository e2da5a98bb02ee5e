"""Build the torchrun lines and the sbatch script of ``autopar launch`` (pure: no I/O, no argv).

Every node runs the same ``torchrun`` with its own ``--node-rank``; torchrun starts
``--nproc-per-node`` processes there, each running ``python -m autopar run PLAN.yaml [MODEL.py]``
(which sees ``WORLD_SIZE``/``RANK`` and applies the plan). Global rank = node_rank *
nproc_per_node + local_rank, which is the ``[pp, dp, cp, tp]`` layout the plan's node column in
``autopar explain`` assumes (node = rank // gpus_per_node).

Under Slurm (``--slurm``) one task per node runs torchrun with the c10d rendezvous on the first
node of the allocation, so no node rank is needed (torchrun assigns them).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.plan import Plan

DEFAULT_PORT = 29500
# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_SLURM_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}|\d+-\d{1,2}:\d{1,2}:\d{1,2})$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?$|^\[?[0-9A-Fa-f:.]+\]?$")
_UNSAFE = re.compile(r"[\x00-\x1f\x7f]")


def check_safe_text(flag: str, value: str) -> None:
    """Refuse control characters (a newline would start a new line of the generated script)."""
    if _UNSAFE.search(value):
        raise AutoparError(f"{flag} {value!r} contains a control character (newline, tab, ...); rename it")


def slurm_job_name(stem: str) -> str:
    """A job name that cannot break the ``#SBATCH`` line: letters, digits, ``._-`` kept, the rest ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem)[:100] or "autopar"


def check_slurm_time(value: str) -> str:
    if not _SLURM_TIME.match(value):
        raise AutoparError(f"--time {value!r} is not a Slurm time limit; use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                           "D-HH:MM:SS")
    return value


@dataclass(frozen=True, kw_only=True)
class Launch:
    """What to start: ``nnodes`` nodes of ``nproc_per_node`` processes each, running ``run_args``."""

    plan_path: str
    nnodes: int
    nproc_per_node: int
    master_addr: str | None
    master_port: int
    run_args: tuple[str, ...] = ()  # after PLAN.yaml: [MODEL.py] and autopar run options

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise AutoparError("--nnodes and --gpus-per-node must be >= 1")
        if not 1 <= self.master_port <= 65535:
            raise AutoparError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.master_addr is not None and not _HOST.match(self.master_addr):
            raise AutoparError(f"--master-addr {self.master_addr!r} is not a host name or IP address")
        check_safe_text("plan path", self.plan_path)
        for a in self.run_args:
            check_safe_text("argument", a)


def check_world_size(plan: Plan, nnodes: int, nproc_per_node: int) -> None:
    """One-line AutoparError unless nnodes x nproc_per_node equals the plan's world size."""
    par, n = plan.parallel, nnodes * nproc_per_node
    if n != par.world_size:
        hint = (f"use --nnodes {par.world_size // nproc_per_node}" if par.world_size % nproc_per_node == 0
                else f"use --gpus-per-node so that nodes x GPUs = {par.world_size}")
        raise AutoparError(
            f"the plan needs {par.world_size} GPUs (dp {par.dp} x tp {par.tp} x pp {par.pp} x cp {par.cp}) but "
            f"{nnodes} node(s) x {nproc_per_node} GPUs per node = {n}; {hint}"
        )


def _run_tail(launch: Launch) -> str:
    return " ".join(shlex.quote(a) for a in ("-m", "autopar", "run", launch.plan_path, *launch.run_args))


def torchrun_lines(launch: Launch) -> list[str]:
    """One command per node, node rank 0 first (run node i's line on node i)."""
    if not launch.master_addr:
        raise AutoparError("--master-addr is required (the host name or IP of node 0) unless --slurm")
    return [
        f"torchrun --nnodes {launch.nnodes} --nproc-per-node {launch.nproc_per_node} --node-rank {i} "
        f"--master-addr {shlex.quote(launch.master_addr)} --master-port {launch.master_port} {_run_tail(launch)}"
        for i in range(launch.nnodes)
    ]


def sbatch_script(launch: Launch, *, job_name: str, time_limit: str | None = None) -> str:
    """A Slurm batch script: one task per node, each running torchrun with the c10d rendezvous."""
    addr = (f"export MASTER_ADDR={shlex.quote(launch.master_addr)}" if launch.master_addr else
            'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)')
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={slurm_job_name(job_name)}",
        f"#SBATCH --nodes={launch.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={launch.nproc_per_node}",
        "#SBATCH --exclusive",
    ]
    if time_limit:
        lines.append(f"#SBATCH --time={check_slurm_time(time_limit)}")
    lines += [
        "",
        "# Generated by 'autopar launch --slurm'. The plan, the model file and the autopar install",
        "# must be visible on every node (shared file system).",
        "set -euo pipefail",
        addr,
        f"export MASTER_PORT={launch.master_port}",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        "",
        f"srun torchrun --nnodes {launch.nnodes} --nproc-per-node {launch.nproc_per_node} "
        '--rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" '
        f"{_run_tail(launch)}",
    ]
    return "\n".join(lines) + "\n"
