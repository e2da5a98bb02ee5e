"""The profile file of ``autopar profile``: read it, derive its cluster sections, write it.

Shared by the layer profiler (``commands/profile``) and the collective profiler (``commands/profile_comm``), so
neither imports the other's command. ``device_info`` is the ``measured.device`` mapping: the
conditions the measurements hold for (autopar.profile_tables.MeasuredConditions), checked against
each run by autopar.profile_conditions.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.profiler.cores import usable_cores


def device_name(device: Any) -> str:
    """The GPU's name, or the CPU's model name (``/proc/cpuinfo``; else the platform's)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


def device_info(device: Any, threads: int, *, dtype: str | None = None, concurrent_ranks: int = 1) -> dict[str, Any]:
    """``measured.device``: what was measured and under which conditions -- the device, torch, the
    threads per rank, the training dtype, how many ranks shared the machine (``concurrent_ranks``;
    ``load_ranks`` kept beside it for files read by older autopar) and its cores."""
    import torch

    info: dict[str, Any] = {"name": device_name(device), "type": device.type, "threads": threads,
                            "torch": str(torch.__version__),
                            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                            "host": platform.node(), "cores": usable_cores()}
    if dtype is not None:
        info["dtype"] = dtype
    if device.type == "cuda":
        info["device_count"] = torch.cuda.device_count()  # the node's GPUs, for a new profile's network
    info["load_ranks"] = info["concurrent_ranks"] = concurrent_ranks
    return info


def read_profile(path: Path) -> dict[str, Any]:
    import yaml

    if not path.exists():
        return {}
    from autopar.yamlload import load_yaml

    try:
        data = load_yaml(path.read_text(encoding="utf-8"), str(path))
    except (OSError, yaml.YAMLError) as exc:
        raise AutoparError(f"cannot update {path}: not a readable YAML profile ({exc})") from None
    if not isinstance(data, dict):
        raise AutoparError(f"cannot update {path}: it is not a YAML mapping")
    return data


def derived_spec(data: dict[str, Any], name: str, info: dict[str, Any], measured: dict[str, Any],
                  gpus_per_node: int | None) -> list[str]:
    """Fill gpu/network/efficiency of a profile that has none (existing sections are kept). A CPU
    profile describes runs on this one machine: its ``gpus_per_node`` is at least the cores; a
    CUDA one the GPUs the node shows. Returns notes for the user (a network that is a placeholder)."""
    notes: list[str] = []
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
        ranks = gpus_per_node or measured.get("comm", {}).get("ranks", 1) or 1
        if info.get("type") == "cpu" and not gpus_per_node:
            ranks = max(ranks, int(info.get("cores") or usable_cores()))
        if info.get("type") == "cuda" and not gpus_per_node:  # the GPUs this node shows, not 1
            ranks = max(ranks, int(info.get("device_count") or 1))
        data["network"] = {"gpus_per_node": ranks,
                           "intra_node": dict(link), "inter_node": dict(link)}
        if "all_reduce" not in comm and info.get("type") == "cuda":
            notes.append(f"network: {ranks} GPU(s) per node with placeholder links (1 GB/s, 50 us): measure them "
                         "with autopar profile --comm, or plan with --cluster h100-80g --profile THIS_FILE")
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
    return notes


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
    busy = ranks >= usable_cores()
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


