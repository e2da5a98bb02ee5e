"""Price a plan under the conditions its measured profile was taken in, or say what differs.

A measured profile (``autopar profile``) holds times for one dtype, one number of threads per
rank, one number of ranks sharing the machine, one device and one torch
(autopar.profile_tables.MeasuredConditions). ``plan``, ``estimate`` and ``validate`` call
``price_for_run`` with the conditions of the run they price; it returns the cluster to price it
with and one warning line per soft difference, or raises a one-line ClusterError where the
prediction would be meaningless. The rules (docs/profiles.md, "Conditions"):

* **dtype** differs (profile measured in fp32, plan in bf16): an **error**. Both the layer tables
  and the fitted kernel figures (peak FLOP/s, memory bandwidth) are of the measured dtype; a bf16
  plan priced from fp32 kernels was +301 % off on a CPU. ``plan`` takes the profile's
  dtype by default, so the error needs an explicit ``--dtype``.
* **device type** differs (validate on cuda with a cpu profile): an **error**.
* **concurrent ranks** (CPU profiles, where the ranks of one run share the cores): the run's ranks
  on this machine R against the profile's R_p (``--load-ranks``, default one per core). The
  profile's compute is rescaled by slowdown(R) / slowdown(R_p) and its collectives (with FSDP2's
  per-tensor time, measured on the same ranks) by slowdown(R) / slowdown(R_comm): ``slowdown`` is the profile's measured contention curve (a
  reference block timed beside 0, 1, 3, ... other ranks: autopar.profiler.contention), and beyond
  it, or for a profile without one, the cores' share max(1, R / cores) -- single-threaded ranks
  beyond the cores time-share them, the rule the profiler's own clock uses. R on the curve: priced
  silently; off it (or no curve): a **warning** that says so and gives the command that measures R.
* **threads per rank**, **device name**, **torch version** (validate: what it runs on now):
  **warnings**.
* A CPU profile describes runs on one machine: the cluster's ``gpus_per_node`` is raised to R so
  that every rank of the plan is on the node its collectives were measured on.

Pure Python (no torch): the planner imports it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from autopar.cluster import Cluster, Link
from autopar.errors import ClusterError
from autopar.profile_tables import LayerPoint, LayerTable, MeasuredConditions, conditions_of


@dataclass(frozen=True, kw_only=True)
class RunConditions:
    """The run a plan is priced for. ``None``: unknown here (plan and estimate do not know the
    machine that will run it; validate does)."""

    dtype: str
    ranks_on_host: int
    device_type: str | None = None
    device_name: str | None = None
    threads_per_rank: int | None = None
    torch_version: str | None = None

    def __post_init__(self) -> None:
        if self.ranks_on_host < 1:
            raise ValueError(f"ranks_on_host must be >= 1, got {self.ranks_on_host}")


@dataclass(frozen=True, kw_only=True)
class Priced:
    """The cluster to price the run with, and one line per soft difference (without a prefix)."""

    cluster: Cluster
    warnings: tuple[str, ...] = ()


def profile_conditions(cluster: Cluster) -> MeasuredConditions | None:
    """The measured conditions of ``cluster``'s profile; None for a datasheet profile."""
    return None if cluster.measured is None else conditions_of(cluster.measured)


def default_dtype(cluster: Cluster, fallback: str = "bf16") -> str:
    """The dtype to plan in when the user gave none: the measured profile's, else ``fallback``."""
    c = profile_conditions(cluster)
    return c.dtype if c is not None and c.measures_compute and c.dtype else fallback


def is_cpu_profile(cluster: Cluster) -> bool:
    c = profile_conditions(cluster)
    return c is not None and c.device_type == "cpu"


def ranks_on_host(cluster: Cluster, num_gpus: int, gpus_per_node: int) -> int:
    """How many ranks of a ``num_gpus`` plan share one machine: all of them for a CPU profile
    (``autopar run`` / ``validate`` start them on this host), else a node's."""
    return num_gpus if is_cpu_profile(cluster) else max(1, min(num_gpus, gpus_per_node))


def _share(ranks: int, cores: int) -> float:
    return max(1.0, ranks / cores)


def slowdown(cond: MeasuredConditions, ranks: int) -> float:
    """How long a rank's compute takes with ``ranks`` ranks on the profiled machine, in units that
    only matter as ratios: the measured contention curve, log-log interpolated between its points
    and beyond its last one times the core share (max(1, R / cores)); without a curve the core
    share alone (1 without a record of the cores).

    The curve is read as its running maximum over R: a rank never computes faster for sharing the
    machine with more ranks, so a point below an earlier one is that measurement's noise (a 2-rank
    reference block timed 7 % under the 1-rank one on the loaded 2-core machine, and the 2-rank
    plans priced from it came out that much too fast)."""
    cores = cond.cores
    curve, top = [], 0.0
    for r, t in cond.contention or ():
        top = max(top, t)
        curve.append((r, top))
    if not curve:
        return _share(ranks, cores) if cores else 1.0
    if ranks <= curve[0][0]:
        return curve[0][1]
    for (r0, t0), (r1, t1) in zip(curve, curve[1:]):
        if r0 <= ranks <= r1:
            w = math.log(ranks / r0) / math.log(r1 / r0)
            return math.exp((1 - w) * math.log(t0) + w * math.log(t1))
    r_last, t_last = curve[-1]
    return t_last * (_share(ranks, cores) / _share(r_last, cores) if cores else 1.0)


def _scaled_table(t: LayerTable, f: float) -> LayerTable:
    def pt(p: LayerPoint) -> LayerPoint:
        return dataclasses.replace(p, fwd_s=p.fwd_s * f, bwd_s=p.bwd_s * f,
                                   core_fwd_s=None if p.core_fwd_s is None else p.core_fwd_s * f)
    return dataclasses.replace(t, regions={r: tuple(pt(p) for p in pts) for r, pts in t.regions.items()})


def _scaled_link(link: Link, f: float) -> Link:
    return dataclasses.replace(
        link, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s / f, latency_s=link.latency_s * f,
        rendezvous_s=link.rendezvous_s * f, fits=tuple((k, lat * f, bw / f) for k, lat, bw in link.fits))


def _reprofile(cond: MeasuredConditions, label: str, model: str, **flags: Any) -> str:
    parts = [f"autopar profile {model}"]
    if cond.device_type:
        parts.append(f"--device {cond.device_type}")
    parts += [f"--{k.replace('_', '-')} {v}" for k, v in flags.items()]
    return " ".join(parts + [f"-o {label}"])


def _fp32_tables(cluster: Cluster) -> dict[str, Any]:
    """Kernel tables for an fp32 plan: the GEMM table's fp32 column (TF32 tensor cores), or, for a
    table without one, its bf16 rates at the fp32 share of peak; no attention table (flash kernels
    take 16-bit inputs only: an fp32 SDPA runs another kernel, priced by the profile's attention
    efficiency)."""
    table = cluster.gemm_table
    if table is not None and "fp32" not in table.dtypes():
        table = table.with_dtype("fp32", like="bf16", factor=cluster.fp32_peak_flops / cluster.peak_flops)
    return {"gemm_table": table, "gemm_dtype": "fp32", "attention_table": None}


def price_for_run(cluster: Cluster, run: RunConditions, *, profile_label: str, model_label: str = "MODEL.py") -> Priced:
    """See the module docstring. ``profile_label``: the profile as the user named it (in messages)."""
    if run.dtype == "fp32" and 0 < cluster.fp32_peak_flops < cluster.peak_flops:
        # a datasheet peak is bf16's; an fp32 plan runs at the TF32 one (a measured peak was
        # measured in the profile's own dtype: with_measured clears fp32_peak_flops)
        cluster = dataclasses.replace(cluster, peak_flops=cluster.fp32_peak_flops, **_fp32_tables(cluster))
    cond = profile_conditions(cluster)
    if cond is None:
        return Priced(cluster=cluster)
    warnings: list[str] = []
    if cond.measures_compute and cond.dtype and cond.dtype != run.dtype:
        raise ClusterError(
            f"{profile_label} was measured in {cond.dtype}, the plan trains in {run.dtype}: its measured times do not "
            f"hold for {run.dtype}; plan with --dtype {cond.dtype} (the default with this profile), or re-profile: "
            + _reprofile(cond, profile_label, model_label, dtype=run.dtype))
    if run.device_type and cond.device_type and run.device_type != cond.device_type:
        raise ClusterError(f"{profile_label} was measured on {cond.device_type}, this run is on {run.device_type}: "
                           f"its times do not apply; profile this device: "
                           + _reprofile(dataclasses.replace(cond, device_type=run.device_type), profile_label,
                                        model_label))
    changes: dict[str, Any] = {}
    if cond.device_type == "cpu":
        R = run.ranks_on_host
        if R > cluster.gpus_per_node:
            changes["gpus_per_node"] = R
        cores = cond.cores
        if cond.measures_compute and cond.concurrent_ranks is not None and R != cond.concurrent_ranks:
            f = slowdown(cond, R) / slowdown(cond, cond.concurrent_ranks)
            covered = bool(cond.contention) and cond.contention[0][0] <= R <= cond.contention[-1][0]
            if not covered:  # measured on the curve: priced as measured, nothing to say
                what = (f"compute times scaled by {f:.2f} (the cores' share)" if abs(f - 1.0) > 1e-9
                        else "its times are used as measured")
                warnings.append(
                    f"{profile_label} was measured with {cond.concurrent_ranks} rank(s) sharing "
                    f"{cores or 'its'} cores, the plan runs {R} on this machine: {what}; for measured figures "
                    f"re-profile: " + _reprofile(cond, profile_label, model_label, load_ranks=R))
            if abs(f - 1.0) > 1e-9:
                m = cluster.measured
                assert m is not None
                if m.layers is not None:
                    changes["measured"] = dataclasses.replace(m, layers=_scaled_table(m.layers, f))
                changes.update(peak_flops=cluster.peak_flops / f,
                               memory_bandwidth_bytes_per_s=cluster.memory_bandwidth_bytes_per_s / f,
                               kernel_overhead_s=cluster.kernel_overhead_s * f)
        if cond.comm_ranks and cores and R > 1 and R != cond.comm_ranks:
            fc = slowdown(cond, R) / slowdown(cond, cond.comm_ranks)
            if abs(fc - 1.0) > 1e-9:
                link = cluster.measured.comm_link if cluster.measured is not None else "intra_node"
                changes[link] = _scaled_link(getattr(cluster, link), fc)
                # framework time: FSDP2's per-tensor CPU time was measured on the same ranks as the collectives
                for name in ("fsdp_gather_s_per_tensor", "fsdp_reduce_s_per_tensor", "dtensor_optimizer_s_per_tensor"):
                    changes[name] = getattr(cluster, name) * fc
        if not cond.comm_ranks and R > 1:
            warnings.append(f"{profile_label} has no measured collectives; communication is priced from defaults; "
                            f"measure them: autopar profile --comm --nproc-per-node {R} -o {profile_label}")
    if run.threads_per_rank is not None and cond.threads_per_rank is not None \
            and run.threads_per_rank != cond.threads_per_rank and cond.measures_compute:
        warnings.append(f"{profile_label} was measured with {cond.threads_per_rank} thread(s) per rank, this run uses "
                        f"{run.threads_per_rank}; re-profile: "
                        + _reprofile(cond, profile_label, model_label, threads=run.threads_per_rank))
    if run.device_name and cond.device_name and run.device_name != cond.device_name and cond.measures_compute:
        warnings.append(f"{profile_label} was measured on {cond.device_name}, this run is on {run.device_name}; "
                        "re-profile on this machine for its figures")
    if run.torch_version and cond.torch_version and _minor(run.torch_version) != _minor(cond.torch_version):
        warnings.append(f"{profile_label} was measured with torch {cond.torch_version}, this run has "
                        f"{run.torch_version}; kernels and collectives may differ: re-profile")
    if changes:
        try:
            cluster = dataclasses.replace(cluster, **changes)
        except (TypeError, ValueError) as exc:
            raise ClusterError(f"{profile_label}: {exc}") from None
    return Priced(cluster=cluster, warnings=tuple(warnings))


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])
