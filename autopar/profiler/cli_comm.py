"""``autopar profile --comm``: collectives on the torchrun ranks, written into a profile (rank 0).

Under torchrun every rank measures (autopar.profiler.comm) and rank 0 merges the fits into the
profile's ``measured.comm`` section (a new profile also gets gpu/network/efficiency sections). With
``--nproc-per-node N`` outside torchrun it launches ``torchrun --standalone`` itself. The process
group is always destroyed, also on error.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

from autopar.errors import AutoparError


def _under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def comm_main(args: argparse.Namespace) -> int:
    from autopar.profiler.cli_profile import relaunch_comm

    if args.model:
        raise AutoparError("--comm profiles collectives only; run 'autopar profile MODEL.py' separately for layers")
    if not _under_torchrun():
        if not args.nproc_per_node or args.nproc_per_node < 2:
            raise AutoparError("--comm needs at least 2 ranks: run it under torchrun or give --nproc-per-node N (N >= 2)")
        return relaunch_comm(args)
    return _measure(args)


def _measure(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from autopar.profiler.cli_profile import _derived_spec, _device_info, read_profile, write_profile
    from autopar.profiler.comm import profile_comm
    from autopar.profiler.tables import comm_to_dict

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
        import autopar.executor.apply  # noqa: F401
    except ImportError:
        pass
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=300))
    try:
        rank0 = dist.get_rank() == 0
        log = (lambda s: print(f"autopar profile --comm: {s}", file=sys.stderr, flush=True)) if rank0 else None
        result = profile_comm(device, repeats=max(3, args.repeats), log=log)
        if rank0:
            out = Path(args.output)
            data = read_profile(out)
            measured = dict(data.get("measured") or {})
            measured["comm"] = comm_to_dict(result["fits"], result["ranks"], result["link"], result["rendezvous_s"])
            if device.type == "cpu":
                measured["memory_baseline_bytes"] = result["memory_baseline_bytes"]
            measured.setdefault("device", _device_info(device, torch.get_num_threads()))
            data["measured"] = measured
            _derived_spec(data, out.stem, measured["device"], measured, args.gpus_per_node or result["ranks"])
            write_profile(out, data)
            print(f"collective profile of {result['ranks']} ranks written to {out}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
