"""``autopar profile``: measure this machine and write (or update) a cluster profile.

    autopar profile MODEL.py [--device cpu|cuda] [--micro-batch 1,2,4] [--tp 1,2] [--cp 1,2]
                    [--threads N] [--dtype fp32] -o profiles/NAME.yaml
    autopar profile --comm --nproc-per-node N -o profiles/NAME.yaml      (launches torchrun)
    torchrun --nproc-per-node N -m autopar profile --comm -o profiles/NAME.yaml

The output is a cluster profile (CONTRACT: existing keys keep their meaning) with a ``measured:``
section (docs/profiles.md). An existing file is updated in place: only the sections measured by
this call are replaced, everything else is kept. A new file also gets ``gpu``, ``network`` and
``efficiency`` sections derived from the measurements, so it works as ``--cluster`` on its own.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from autopar.cliargs import int_list
from autopar.errors import AutoparError


def _kind_list(text: str) -> tuple[str, ...]:
    kinds = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [k for k in kinds if k not in ("ring", "allgather", "ulysses")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown cp kind {bad[0]!r}; one of ring, allgather, ulysses")
    return kinds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.py", nargs="?", help="model file whose layers to time (not with --comm)")
    p.add_argument("-o", "--output", metavar="PATH", required=True, help="profile YAML to write or update")
    p.add_argument("--device", choices=("cpu", "cuda"), help="device to measure (default: cuda if available)")
    p.add_argument("--micro-batch", type=int_list, default=(1, 2, 4), metavar="1,2,4", help="micro-batch sizes")
    p.add_argument("--tp", type=int_list, default=(1, 2), metavar="1,2", help="tensor-parallel degrees to shard the block for")
    p.add_argument("--cp", type=int_list, default=(1, 2), metavar="1,2",
                   help="context-parallel degrees: the block is also timed at SEQ_LEN / cp tokens")
    p.add_argument("--cp-kind", type=_kind_list, default=("ring", "allgather", "ulysses"), metavar="ring,allgather,ulysses",
                   help="cp > 1: also time the block with the executor's cp attention of these kinds (default all)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="training dtype (default fp32 on cpu, bf16 on cuda)")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads (torch.set_num_threads); default 1 on cpu")
    p.add_argument("--repeats", type=int, default=7, metavar="R", help="timed runs per shape (median; default 7)")
    p.add_argument("--warmup", type=int, default=3, metavar="W", help="untimed runs first (default 3)")
    p.add_argument("--no-kernels", action="store_true", help="skip the GEMM and memory-bandwidth sweeps")
    p.add_argument("--load-ranks", type=int, default=1, metavar="N",
                   help="measure as one of N ranks sharing this machine: N-1 helper processes train the same "
                        "block alongside (CPU runs with more ranks than cores; default 1)")
    p.add_argument("--comm", action="store_true", help="profile collectives on the torchrun ranks instead of layers")
    p.add_argument("--nproc-per-node", type=int, metavar="N", help="with --comm: launch N ranks with torchrun")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="network.gpus_per_node of a new profile (default: ranks)")
    from autopar.usercode import add_timeout_argument

    add_timeout_argument(p)


def _device_info(device: Any, threads: int) -> dict[str, Any]:
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return {"name": name, "type": device.type, "threads": threads, "torch": str(torch.__version__),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "host": platform.node()}


def read_profile(path: Path) -> dict[str, Any]:
    import yaml

    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise AutoparError(f"cannot update {path}: not a readable YAML profile ({exc})") from None
    if not isinstance(data, dict):
        raise AutoparError(f"cannot update {path}: it is not a YAML mapping")
    return data


def _derived_spec(data: dict[str, Any], name: str, info: dict[str, Any], measured: dict[str, Any],
                  gpus_per_node: int | None) -> None:
    """Fill gpu/network/efficiency of a profile that has none (existing sections are kept)."""
    f = measured.get("fitted", {})
    data.setdefault("name", name)
    if "gpu" not in data:
        mem = _device_memory_bytes(info)
        data["gpu"] = {"name": info.get("name", "unknown"), "peak_flops": f.get("peak_flops", 1e11),
                       "memory_bytes": mem, "memory_bandwidth_bytes_per_s": f.get("memory_bandwidth_bytes_per_s", 1e10),
                       "framework_reserve_bytes": measured.get("memory_baseline_bytes", 3.2e8 if info.get("type") == "cpu" else 1e9)}
    if "network" not in data:
        comm = measured.get("comm", {}).get("collectives", {})
        ar = comm.get("all_reduce", {"latency_s": 5e-5, "bandwidth_bytes_per_s": 1e9})
        link = {"bandwidth_bytes_per_s": ar["bandwidth_bytes_per_s"], "latency_s": ar["latency_s"]}
        data["network"] = {"gpus_per_node": gpus_per_node or measured.get("comm", {}).get("ranks", 1) or 1,
                           "intra_node": dict(link), "inter_node": dict(link)}
    elif data["gpu"].get("name") == info.get("name"):  # a profile of this device: keep it in step with the fits
        for key, src in (("peak_flops", "peak_flops"), ("memory_bandwidth_bytes_per_s", "memory_bandwidth_bytes_per_s")):
            if src in f:
                data["gpu"][key] = f[src]
        if "memory_baseline_bytes" in measured:
            data["gpu"]["framework_reserve_bytes"] = measured["memory_baseline_bytes"]
    if "efficiency" not in data:
        data["efficiency"] = {"gemm_max": f.get("gemm_max", 1.0), "gemm_half_dim": f.get("gemm_half_dim", 16.0),
                              "attention": 0.5, "memory": f.get("memory_efficiency", 1.0),
                              "kernel_overhead_s": f.get("kernel_overhead_s", 5e-6)}
    if info.get("type") == "cpu" and data["gpu"].get("name") == info.get("name"):
        _cpu_overlap(data, info, measured)


def _cpu_overlap(data: dict[str, Any], info: dict[str, Any], measured: dict[str, Any]) -> None:
    """Whether communication can hide behind compute on this CPU machine. A collective runs on
    gloo's own threads; it is free only while a core is idle. With as many single-threaded ranks as
    cores or more (the comm profile's ranks, or ``--load-ranks``), no core is idle: the gradient
    all-reduce and the ZeRO collectives cost their whole time (``overlap_grad_reduce: false``,
    ``overlap_cost_fraction: 1``). Measured: the ranks' gloo threads used ~20 ms of CPU per step
    for a 26 MB all-reduce at 4 ranks on 2 cores, all of it added to the step."""
    comm = measured.get("comm") or {}
    ranks = max(int(comm.get("ranks", 0)) if comm.get("link", "intra_node") == "intra_node" else 0,
                int(info.get("load_ranks", 1)))
    busy = ranks >= (os.cpu_count() or 1)
    data.setdefault("software", {})["overlap_grad_reduce"] = not busy
    eff = data.setdefault("efficiency", {})
    if busy:
        eff["overlap_cost_fraction"] = 1.0
    else:
        eff.pop("overlap_cost_fraction", None)


def _device_memory_bytes(info: dict[str, Any]) -> float:
    if info.get("type") == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16.0 * 2**30


def write_profile(path: Path, data: dict[str, Any]) -> None:
    import yaml

    from autopar.cluster import cluster_from_dict
    from autopar.plan import write_text_atomic

    cluster_from_dict(data, path.stem, path)  # never write a profile that would not load
    order = ["name", "gpu", "network", "efficiency", "software"]
    data = {**{k: data[k] for k in order if k in data}, **{k: v for k, v in data.items() if k not in order}}
    header = "# Written by `autopar profile`; the measured: section is described in docs/profiles.md.\n"
    write_text_atomic(path, header + yaml.safe_dump(data, sort_keys=False, width=120, default_flow_style=None))


def main(args: argparse.Namespace) -> int:
    if args.comm:
        from autopar.profiler.cli_comm import comm_main

        return comm_main(args)
    if not args.model:
        raise AutoparError("autopar profile needs MODEL.py (or --comm to profile collectives)")
    if args.nproc_per_node:
        raise AutoparError("--nproc-per-node goes with --comm; layer profiling runs in this process")
    from autopar.outputs import check_output_file
    from autopar.usercode import configure

    configure(timeout_s=args.timeout)
    check_output_file(args.output, "-o")  # before minutes of measuring
    return _layers_main(args)


def _layers_main(args: argparse.Namespace) -> int:
    import torch

    from autopar.modelfile import load_model_file
    from autopar.profiler.kernels import profile_kernels
    from autopar.profiler.layers import LayerProfileConfig, profile_layers
    from autopar.profiler.load import start_load, stop_load
    from autopar.profiler.tables import layer_table_to_dict

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise AutoparError("--device cuda: no CUDA device is available here; use --device cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("fp32" if device.type == "cpu" else "bf16")
    if args.repeats < 1 or args.warmup < 0:
        raise AutoparError("--repeats must be >= 1 and --warmup >= 0")
    mf = load_model_file(args.model)
    out = Path(args.output)
    data = read_profile(out)
    info = _device_info(device, torch.get_num_threads())
    measured = dict(data.get("measured") or {})
    old = measured.get("model") or {}
    if old.get("sha256") and old.get("sha256") != mf.sha256:
        print(f"autopar profile: replacing the layer table of {old.get('name')} in {out}", file=sys.stderr)
    log = lambda s: print(f"autopar profile: {s}", file=sys.stderr, flush=True)  # noqa: E731
    cfg = LayerProfileConfig(micro_batches=args.micro_batch, tps=args.tp, cps=args.cp, dtype=dtype,
                             cp_kinds=getattr(args, "cp_kind", LayerProfileConfig.cp_kinds),
                             ranks_per_machine=args.load_ranks,
                             warmup=args.warmup, repeats=args.repeats)
    helpers = start_load(args.load_ranks - 1, device.type, args.model, max(args.micro_batch))
    try:
        table = profile_layers(mf, device, cfg, log=log)
        kernels = None if args.no_kernels else profile_kernels(device, dtype)
    except ValueError as exc:
        raise AutoparError(str(exc)) from None
    finally:
        stop_load(helpers)
    info["load_ranks"] = args.load_ranks
    measured["device"] = info
    measured["model"], measured["layers"] = layer_table_to_dict(table)
    if kernels is not None:
        measured.update({k: kernels[k] for k in ("gemm", "memory_bandwidth")})
        measured["fitted"] = {**measured.get("fitted", {}), **kernels["fitted"]}
    data["measured"] = measured
    _derived_spec(data, out.stem, info, measured, args.gpus_per_node)
    write_profile(out, data)
    print(f"profile written to {out} ({sum(len(v) for v in measured['layers'].values())} layer points, "
          f"device {info['name']}, {info['threads']} thread(s))")
    return 0


def relaunch_comm(args: argparse.Namespace) -> int:
    """``--comm --nproc-per-node N`` outside torchrun: start the ranks with torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}",
           "-m", "autopar", "profile", "--comm", "-o", str(args.output), "--repeats", str(args.repeats)]
    if args.gpus_per_node:
        cmd += ["--gpus-per-node", str(args.gpus_per_node)]
    if args.device:
        cmd += ["--device", args.device]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(cmd, env=env)
