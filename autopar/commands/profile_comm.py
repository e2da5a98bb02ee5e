"""``autopar profile --comm``: collectives on N ranks, written into a profile (rank 0).

Every rank measures (autopar.profiler.comm, then FSDP2's per-tensor time: autopar.profiler.fsdp)
and rank 0 merges the fits into the profile's ``measured.comm`` section (a new profile also gets gpu/network/efficiency sections). With
``--nproc-per-node N`` outside torchrun the ranks are started by autopar's own single-node launcher
(autopar.launch.local, as ``autopar run`` and ``autopar validate`` do: loopback only, one line for
a rank that dies); under your own ``torchrun`` every rank measures as started. The process group is
always destroyed, also on error.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

from autopar.errors import AutoparError
from autopar.launch.rank import under_launcher


def comm_main(args: argparse.Namespace) -> int:
    if args.model:
        raise AutoparError("--comm profiles collectives only; run 'autopar profile MODEL.py' separately for layers")
    if not under_launcher():
        if not args.nproc_per_node or args.nproc_per_node < 2:
            raise AutoparError("--comm needs at least 2 ranks: run it under torchrun or give --nproc-per-node N (N >= 2)")
        return launch_comm(args.output, args.nproc_per_node, repeats=args.repeats, device=args.device,
                           gpus_per_node=args.gpus_per_node)
    return _measure(args)


def launch_comm(output: str | Path, nproc: int, *, repeats: int, device: str | None = None,
                gpus_per_node: int | None = None) -> int:
    """Start ``nproc`` ranks of ``autopar profile --comm`` on this host (launch/local.py)."""
    from autopar.launch.local import LocalJob, run_local

    cmd = ["-m", "autopar", "profile", "--comm", "-o", str(output), "--repeats", str(repeats)]
    if gpus_per_node:
        cmd += ["--gpus-per-node", str(gpus_per_node)]
    if device:
        cmd += ["--device", device]
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return run_local(LocalJob(argv=tuple(cmd), nproc=nproc, env=env))


def _measure(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from autopar.launch.rank import arm_parent_death_signal, join_process_group
    from autopar.profile_tables import comm_to_dict
    from autopar.profiler.comm import profile_comm
    from autopar.profiler.fsdp import profile_fsdp
    from autopar.profiler.profile_file import derived_spec, device_info, read_profile, write_profile

    arm_parent_death_signal()
    if int(os.environ["WORLD_SIZE"]) < 2:
        raise AutoparError("--comm needs at least 2 ranks (torchrun --nproc-per-node N, N >= 2)")
    use_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    try:  # what a training rank has loaded before its model: the RSS baseline is measured like it
        import autopar.executor.parallel.apply  # noqa: F401
    except ImportError:
        pass
    join_process_group("nccl" if use_cuda else "gloo", timedelta(seconds=300))
    try:
        rank0 = dist.get_rank() == 0
        log = (lambda s: print(f"autopar profile --comm: {s}", file=sys.stderr, flush=True)) if rank0 else None
        result = profile_comm(device, repeats=max(3, args.repeats), log=log)
        # Measured profiles' framework time: FSDP2's own time per tensor, beyond the collectives just fitted (same ranks)
        fsdp = profile_fsdp(device, result["fits"], result["rendezvous_s"], log=log)
        if rank0:
            out = Path(args.output)
            data = read_profile(out)
            measured = dict(data.get("measured") or {})
            measured["comm"] = comm_to_dict(result["fits"], result["ranks"], result["link"], result["rendezvous_s"],
                                            fsdp=fsdp)
            if device.type == "cpu":
                measured["memory_baseline_bytes"] = result["memory_baseline_bytes"]
            measured.setdefault("device", device_info(device, torch.get_num_threads(),
                                                      concurrent_ranks=int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                                          result["ranks"]))))
            data["measured"] = measured
            derived_spec(data, out.stem, measured["device"], measured, args.gpus_per_node or result["ranks"])
            write_profile(out, data)
            print(f"collective profile of {result['ranks']} ranks written to {out}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
