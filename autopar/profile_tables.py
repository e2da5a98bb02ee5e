"""Measured profile data: what ``autopar profile`` writes and the cost model reads.

Planner data beside ``autopar.cluster`` (which layers it over a cluster profile), not in the
profiler's package: pure Python (no torch), imported by the planner; it imports nothing of autopar
but the errors, so ``cluster`` -> ``profile_tables`` is one-way. The YAML lives under the optional ``measured:``
key of a cluster profile (docs/profiles.md); every part of it is optional:

    measured:
      device: {name, type, threads, torch, date, host, [dtype, concurrent_ranks, load_ranks, cores,
               contention: [[ranks, seconds], ...]]}
      model: {name, sha256, dtype, seq_len, edges_replicated}
      layers: {pre|block|post|loss: [{b, s, tp, [cp, cp_kind,] fwd_s, bwd_s, saved_bytes, peak_bytes,
                                      [core_fwd_s]}, ...]}
      gemm: [{m, n, k, flops_per_s}, ...]
      attention: [{direction, mask, head_dim, kv_tokens, flops_per_s}, ...]   (CUDA: torch's flash SDPA)
      memory_bandwidth: [{bytes, bytes_per_s}, ...]
      fitted: {peak_flops, gemm_max, gemm_half_dim, memory_bandwidth_bytes_per_s, kernel_overhead_s}
      memory_baseline_bytes: <process memory before any model state, per rank>
      comm: {ranks, link, rendezvous_s, collectives: {all_reduce: {latency_s, bandwidth_bytes_per_s, points: [...]}}}

``model.edges_replicated``: false (what ``autopar profile`` writes) -- every region has points at
each measured tp, the edges as one tp rank of the executor runs them (vocab/tp embedding rows,
vocab/tp head columns and the loss on that logit slice, as under ``loss_parallel``); true (tables
written before the edges were measured sharded) -- pre/post/loss were measured whole at tp = 1
only, and the cost model prices them as replicated on every tp rank, as it always did for them.
A file without the key reads as false.

Interpolation (``LayerTable.lookup``): points of the same context-parallel kind (``cp`` > 1 with a
``cp_kind``: the block as a cp rank of the executor runs it, e.g. ring attention over s/cp queries
and all s keys; when the table has none for the asked cp and kind, the plain points, cp = 1) and of
the same tp (exact match; else the nearest tp);
inside the measured (b, s) grid, bilinear in (log b, log s) on log values -- exact at measured
points, monotone between monotone points; outside it, the value at the nearest grid point (the
caller rescales that by the roofline ratio of the asked shape to the clamped one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from autopar.errors import ClusterError

REGIONS = ("pre", "block", "post", "loss")
LAYER_KEYS = ("fwd_s", "bwd_s", "saved_bytes", "peak_bytes")
OPTIONAL_LAYER_KEYS = ("core_fwd_s",)  # interpolated only where every point used has it
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True, kw_only=True)
class LayerPoint:
    """One region measured at micro-batch ``b``, ``s`` tokens per sample (local to a CP rank) and
    tensor-parallel degree ``tp``: median forward/backward seconds, bytes kept for backward, and
    the peak of live bytes during its forward+backward (activations, gradients, temporaries).
    ``core_fwd_s`` (block only; None in tables made before it was measured): the forward seconds of
    the attention core alone -- what selective recompute re-runs in backward.
    ``cp`` > 1: measured with the attention core of a ``cp_kind`` context-parallel rank (ring,
    allgather, ulysses) on a loopback group -- its compute, without the transfers."""

    b: int
    s: int
    tp: int
    fwd_s: float
    bwd_s: float
    saved_bytes: float = 0.0
    peak_bytes: float = 0.0
    cp: int = 1
    cp_kind: str = ""
    core_fwd_s: float | None = None

    def __post_init__(self) -> None:
        if self.core_fwd_s is not None and self.core_fwd_s < 0:
            raise ClusterError(f"measured layer point b={self.b} s={self.s} tp={self.tp}: core_fwd_s must be >= 0")
        if self.b < 1 or self.s < 1 or self.tp < 1 or self.cp < 1:
            raise ClusterError(f"measured layer point b={self.b} s={self.s} tp={self.tp} cp={self.cp}: all must be >= 1")
        if (self.cp > 1) != bool(self.cp_kind):
            raise ClusterError(f"measured layer point b={self.b} s={self.s} cp={self.cp}: cp_kind is given exactly when cp > 1")
        if self.fwd_s < 0 or self.bwd_s < 0:
            raise ClusterError(f"measured layer point b={self.b} s={self.s} tp={self.tp}: times must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Lookup:
    """An interpolated point and where it was taken (b, s, tp may differ from what was asked)."""

    b: float
    s: float
    tp: int
    values: Mapping[str, float]
    cp: int = 1  # the cp of the points used: 1 when the table has none for the asked cp and kind
    cp_kind: str = ""


@dataclass(frozen=True, kw_only=True)
class LayerTable:
    """Per-region measurements of one model file (identified by sha256) in one dtype."""

    model_name: str
    model_sha256: str
    dtype: str
    seq_len: int
    # True: an old table, pre/post/loss measured with the full vocabulary at tp = 1 only and priced
    # as replicated; False: their points at tp > 1 are one tp rank's vocabulary shard (module docstring).
    edges_replicated: bool
    regions: Mapping[str, tuple[LayerPoint, ...]] = field(default_factory=dict)

    def lookup(self, region: str, b: float, s: float, tp: int, cp: int = 1, cp_kind: str = "") -> Lookup | None:
        """The region's measurements at (b, s, tp) for a ``cp_kind`` rank of ``cp``; see the module
        docstring. None: no points."""
        every = self.regions.get(region, ())
        points = [p for p in every if p.cp == cp and p.cp_kind == cp_kind] if cp > 1 else []
        if not points:
            cp, cp_kind = 1, ""
            points = [p for p in every if p.cp == 1]
        if not points:
            return None
        tps = sorted({p.tp for p in points})
        use_tp = tp if tp in tps else min(tps, key=lambda t: (abs(math.log(t / tp)), t))
        pts = [p for p in points if p.tp == use_tp]
        bs = sorted({p.b for p in pts})
        ss = sorted({p.s for p in pts})
        cb = min(max(b, bs[0]), bs[-1])
        cs = min(max(s, ss[0]), ss[-1])
        grid = {(p.b, p.s): p for p in pts}
        b0, b1 = _bracket(bs, cb)
        s0, s1 = _bracket(ss, cs)
        corners = [grid.get(k) for k in ((b0, s0), (b1, s0), (b0, s1), (b1, s1))]
        if any(c is None for c in corners):  # incomplete grid: the nearest point in log distance
            near = min(pts, key=lambda p: (math.log(p.b / cb)) ** 2 + (math.log(p.s / cs)) ** 2)
            values = {k: getattr(near, k) for k in LAYER_KEYS}
            values.update({k: getattr(near, k) for k in OPTIONAL_LAYER_KEYS if getattr(near, k) is not None})
            return Lookup(b=near.b, s=near.s, tp=use_tp, values=values, cp=cp, cp_kind=cp_kind)
        wb = _weight(b0, b1, cb)
        ws = _weight(s0, s1, cs)
        values = {}
        for k in LAYER_KEYS + OPTIONAL_LAYER_KEYS:
            if any(getattr(c, k) is None for c in corners):
                continue
            v00, v10, v01, v11 = (getattr(c, k) for c in corners)
            lo = _mix(v00, v10, wb)
            hi = _mix(v01, v11, wb)
            values[k] = _mix(lo, hi, ws)
        return Lookup(b=cb, s=cs, tp=use_tp, values=values, cp=cp, cp_kind=cp_kind)


def _bracket(values: list[int], x: float) -> tuple[int, int]:
    for lo, hi in zip(values, values[1:]):
        if lo <= x <= hi:
            return lo, hi
    return values[0], values[0]


def _weight(lo: float, hi: float, x: float) -> float:
    return 0.0 if hi == lo else math.log(x / lo) / math.log(hi / lo)


def _mix(a: float, b: float, w: float) -> float:
    """Interpolate ``a`` -> ``b`` at weight ``w``: geometric when both are > 0, else linear."""
    if w == 0.0:
        return a
    if w == 1.0:
        return b
    if a > 0 and b > 0:
        return math.exp((1 - w) * math.log(a) + w * math.log(b))
    return (1 - w) * a + w * b


@dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """One collective on one link: t = hops(n) * latency_s + volume(n, M) / bandwidth (nccl-tests
    bus-bandwidth convention, see autopar.cost.comm), fitted over message sizes and group sizes."""

    kind: str
    latency_s: float
    bandwidth_bytes_per_s: float
    points: tuple[tuple[int, float, float], ...] = ()  # (ranks, message bytes, seconds)

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVES:
            raise ClusterError(f"measured comm: unknown collective {self.kind!r}; one of {', '.join(COLLECTIVES)}")
        if self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0:
            raise ClusterError(f"measured comm {self.kind}: bandwidth must be > 0 and latency >= 0")


@dataclass(frozen=True, kw_only=True)
class MeasuredProfile:
    """Everything ``autopar profile`` measured; each part optional."""

    device: Mapping[str, Any] = field(default_factory=dict)
    layers: LayerTable | None = None
    gemm: tuple[Mapping[str, float], ...] = ()
    attention: tuple[Mapping[str, Any], ...] = ()  # fused attention rates by key length (profiler/attention_kernels.py)
    memory_bandwidth: tuple[Mapping[str, float], ...] = ()
    fitted: Mapping[str, float] = field(default_factory=dict)
    memory_baseline_bytes: float | None = None
    comm_link: str = "intra_node"
    comm_ranks: int = 0
    comm: Mapping[str, CollectiveFit] = field(default_factory=dict)
    comm_rendezvous_s: float = 0.0  # extra per blocking collective between compute (autopar.profiler.comm)
    # framework time: FSDP2 / DTensor seconds per parameter tensor (autopar.profiler.fsdp; cost.framework)
    comm_fsdp: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class MeasuredConditions:
    """What a measured profile's figures hold for (``measured.device``; None: not recorded, as in
    files written before the key was). ``dtype``: the training dtype the layer tables and kernel
    curves were measured in. ``concurrent_ranks``: how many single-threaded ranks shared the
    machine while the layers were timed (``--load-ranks``; older files: ``load_ranks``).
    ``comm_ranks``: the ranks the collectives were fitted on (0: none measured)."""

    device_type: str | None = None
    device_name: str | None = None
    dtype: str | None = None
    threads_per_rank: int | None = None
    concurrent_ranks: int | None = None
    cores: int | None = None
    torch_version: str | None = None
    comm_ranks: int = 0
    measures_compute: bool = False  # layer tables or fitted kernel figures: times that depend on the above
    # ((ranks, seconds), ...): a reference block's time beside ranks - 1 others (autopar.profiler.contention)
    contention: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for key in ("threads_per_rank", "concurrent_ranks", "cores"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ClusterError(f"measured.device: {key} must be >= 1, got {v}")


def _opt_int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterError(f"{where} must be an integer, got {value!r}")
    return value


def conditions_of(m: MeasuredProfile) -> MeasuredConditions:
    """The conditions recorded in ``m`` (see MeasuredConditions)."""
    d = m.device
    dtype = d.get("dtype") or (m.layers.dtype if m.layers is not None else None)
    ranks = d.get("concurrent_ranks", d.get("load_ranks"))
    return MeasuredConditions(
        device_type=None if d.get("type") is None else str(d["type"]),
        device_name=None if d.get("name") is None else str(d["name"]),
        dtype=None if dtype is None else str(dtype),
        threads_per_rank=_opt_int(d.get("threads"), "measured.device.threads"),
        concurrent_ranks=_opt_int(ranks, "measured.device.concurrent_ranks"),
        cores=_opt_int(d.get("cores"), "measured.device.cores"),
        torch_version=None if d.get("torch") is None else str(d["torch"]),
        comm_ranks=m.comm_ranks if m.comm else 0,
        measures_compute=m.layers is not None or bool(m.fitted),
        contention=_curve(d.get("contention"), "measured.device.contention"),
    )


def _curve(value: Any, where: str) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ClusterError(f"{where} must be a list of [ranks, seconds]")
    out = []
    for row in value:
        if not isinstance(row, (list, tuple)) or len(row) != 2:
            raise ClusterError(f"{where} must be a list of [ranks, seconds], got {row!r}")
        ranks, secs = _opt_int(row[0], where), parse_number(row[1], where)
        if ranks is None or ranks < 1 or secs <= 0:
            raise ClusterError(f"{where}: ranks must be >= 1 and seconds > 0, got {row!r}")
        out.append((ranks, secs))
    return tuple(sorted(out))


FITTED_KEYS = ("peak_flops", "gemm_max", "gemm_half_dim", "memory_bandwidth_bytes_per_s", "memory_efficiency",
               "kernel_overhead_s", "attention_efficiency", "optimizer_bytes_per_param")


def parse_number(value: Any, where: str) -> float:
    """A profile number. YAML 1.1 reads "312.0e12" (no sign after e) as a string, so strings that
    float() accepts are numbers too; anything else (bools included) is a ClusterError."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where} must be a number, got {value!r}")
    return float(value)


_number = parse_number


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ClusterError(f"{where} must be a mapping")
    return value


ATTENTION_ROW_KEYS = ("direction", "mask", "head_dim", "kv_tokens", "flops_per_s")


def _attention_rows(rows: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    """The ``attention`` rows, each with its keys and a direction / mask the tables know."""
    if not isinstance(rows, list):
        raise ClusterError(f"{where} must be a list of rows")
    out = []
    for i, row in enumerate(rows):
        row = _mapping(row, f"{where}[{i}]")
        missing = [k for k in ATTENTION_ROW_KEYS if k not in row]
        if missing:
            raise ClusterError(f"{where}[{i}]: missing key '{missing[0]}'")
        if row["direction"] not in ("forward", "backward") or row["mask"] not in ("full", "causal"):
            raise ClusterError(f"{where}[{i}]: direction must be forward or backward, mask full or causal")
        out.append({**row, "flops_per_s": _number(row["flops_per_s"], f"{where}[{i}].flops_per_s")})
    return tuple(out)


def measured_from_dict(data: Any, where: str) -> MeasuredProfile:
    """Parse the ``measured:`` section (``where`` names the file in errors)."""
    where = f"{where} measured"
    data = _mapping(data, where)
    unknown = sorted(set(data) - {"device", "model", "layers", "gemm", "attention", "memory_bandwidth", "fitted",
                                  "memory_baseline_bytes", "comm", "whole_model"})
    if unknown:
        raise ClusterError(f"{where}: unknown key '{unknown[0]}'")
    layers = None
    if "layers" in data:
        model = _mapping(data.get("model"), f"{where}.model (needed by layers)")
        regions: dict[str, tuple[LayerPoint, ...]] = {}
        for region, rows in _mapping(data["layers"], f"{where}.layers").items():
            if region not in REGIONS:
                raise ClusterError(f"{where}.layers: unknown region '{region}'; one of {', '.join(REGIONS)}")
            if not isinstance(rows, list):
                raise ClusterError(f"{where}.layers.{region} must be a list of points")
            pts = []
            for i, row in enumerate(rows):
                row = _mapping(row, f"{where}.layers.{region}[{i}]")
                try:
                    pts.append(LayerPoint(
                        b=int(row["b"]), s=int(row["s"]), tp=int(row["tp"]),
                        fwd_s=_number(row["fwd_s"], f"{where}.layers.{region}[{i}].fwd_s"),
                        bwd_s=_number(row["bwd_s"], f"{where}.layers.{region}[{i}].bwd_s"),
                        saved_bytes=_number(row.get("saved_bytes", 0.0), f"{where}.layers.{region}[{i}].saved_bytes"),
                        peak_bytes=_number(row.get("peak_bytes", 0.0), f"{where}.layers.{region}[{i}].peak_bytes"),
                        cp=int(row.get("cp", 1)), cp_kind=str(row.get("cp_kind", "")),
                        core_fwd_s=None if row.get("core_fwd_s") is None else
                        _number(row["core_fwd_s"], f"{where}.layers.{region}[{i}].core_fwd_s"),
                    ))
                except KeyError as exc:
                    raise ClusterError(f"{where}.layers.{region}[{i}]: missing key {exc}") from None
            regions[region] = tuple(pts)
        layers = LayerTable(
            model_name=str(model.get("name", "")), model_sha256=str(model.get("sha256", "")),
            dtype=str(model.get("dtype", "bf16")), seq_len=int(model.get("seq_len", 1)),
            edges_replicated=bool(model.get("edges_replicated", False)), regions=regions,
        )
    fitted = {}
    for k, v in _mapping(data.get("fitted", {}), f"{where}.fitted").items():
        if k not in FITTED_KEYS:
            raise ClusterError(f"{where}.fitted: unknown key '{k}'; allowed: {', '.join(FITTED_KEYS)}")
        fitted[k] = _number(v, f"{where}.fitted.{k}")
    comm: dict[str, CollectiveFit] = {}
    comm_data = _mapping(data.get("comm", {}), f"{where}.comm")
    for kind, fit in _mapping(comm_data.get("collectives", {}), f"{where}.comm.collectives").items():
        fit = _mapping(fit, f"{where}.comm.collectives.{kind}")
        points = tuple((int(p[0]), float(p[1]), float(p[2])) for p in fit.get("points", []))
        comm[kind] = CollectiveFit(kind=kind, latency_s=_number(fit.get("latency_s"), f"{where}.comm.{kind}.latency_s"),
                                   bandwidth_bytes_per_s=_number(fit.get("bandwidth_bytes_per_s"),
                                                                 f"{where}.comm.{kind}.bandwidth_bytes_per_s"),
                                   points=points)
    link = str(comm_data.get("link", "intra_node"))
    if link not in ("intra_node", "inter_node"):
        raise ClusterError(f"{where}.comm.link must be intra_node or inter_node, got {link!r}")
    baseline = data.get("memory_baseline_bytes")
    return MeasuredProfile(
        device=dict(_mapping(data.get("device", {}), f"{where}.device")),
        layers=layers,
        gemm=tuple(dict(r) for r in data.get("gemm", []) or []),
        attention=_attention_rows(data.get("attention", []) or [], f"{where}.attention"),
        memory_bandwidth=tuple(dict(r) for r in data.get("memory_bandwidth", []) or []),
        fitted=fitted,
        memory_baseline_bytes=None if baseline is None else _number(baseline, f"{where}.memory_baseline_bytes"),
        comm_link=link, comm_ranks=int(comm_data.get("ranks", 0)), comm=comm,
        comm_rendezvous_s=_number(comm_data.get("rendezvous_s", 0.0), f"{where}.comm.rendezvous_s"),
        comm_fsdp=_fsdp(comm_data.get("fsdp", {}), f"{where}.comm.fsdp"),
    )


FSDP_FIGURES = ("gather_s_per_tensor", "reduce_s_per_tensor", "optimizer_s_per_tensor")


def _fsdp(value: Any, where: str) -> dict[str, float]:
    """``measured.comm.fsdp`` (framework time): the three per-tensor figures, each >= 0; absent: {}."""
    data = _mapping(value, where)
    unknown = sorted(set(data) - set(FSDP_FIGURES) - {"tensors", "units"}, key=str)
    if unknown:
        raise ClusterError(f"{where}: unknown key '{unknown[0]}'; allowed: {', '.join(FSDP_FIGURES)}, tensors, units")
    out = {}
    for key in FSDP_FIGURES:
        if key in data:
            out[key] = _number(data[key], f"{where}.{key}")
            if out[key] < 0:
                raise ClusterError(f"{where}.{key} must be >= 0, got {out[key]}")
    return out


def layer_table_to_dict(table: LayerTable) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model section, layers section) of the YAML."""
    model = {"name": table.model_name, "sha256": table.model_sha256, "dtype": table.dtype,
             "seq_len": table.seq_len, "edges_replicated": table.edges_replicated}
    layers = {region: [{"b": p.b, "s": p.s, "tp": p.tp, **({"cp": p.cp, "cp_kind": p.cp_kind} if p.cp > 1 else {}),
                        "fwd_s": p.fwd_s, "bwd_s": p.bwd_s, "saved_bytes": p.saved_bytes, "peak_bytes": p.peak_bytes,
                        **({"core_fwd_s": p.core_fwd_s} if p.core_fwd_s is not None else {})}
                       for p in pts]
              for region, pts in table.regions.items()}
    return model, layers


def comm_to_dict(fits: Mapping[str, CollectiveFit], ranks: int, link: str, rendezvous_s: float = 0.0,
                 fsdp: Mapping[str, float] | None = None) -> dict[str, Any]:
    out = {"ranks": ranks, "link": link, "rendezvous_s": rendezvous_s, "collectives": {
        k: {"latency_s": f.latency_s, "bandwidth_bytes_per_s": f.bandwidth_bytes_per_s,
            "points": [list(p) for p in f.points]} for k, f in fits.items()}}
    if fsdp:  # framework time (absent from profiles measured before it)
        out["fsdp"] = dict(fsdp)
    return out
