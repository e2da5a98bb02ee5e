"""Kernel tables: a GPU's GEMM and fused-attention throughput by shape, measured or published.

A cluster profile names them in its ``kernels:`` section (docs/profiles.md):

    kernels:
      gemm: h100-sxm-gemm-xla              # profiles/kernels/<name>.yaml, or a path to a .yaml
      attention: h100-sxm-attention-fa3-paper
      attention_kernel: fa2                # which of the table's kernels the software runs

and the cost model prices each traced GEMM and attention op at the rate its table gives for that
op's own shape (cost/compute.py), instead of a peak times an efficiency fitted to whole runs. A
table file must say where its figures come from (``source:``): one without is refused.

GEMM (``kind: gemm``): rows ``[b, m, n, k, <rate per dtype>...]`` in TFLOP/s, 2 b m n k FLOPs per
call. A batched GEMM's batch is folded into m (b x m rows of output tiles fill the SMs as one GEMM of
b m rows does; on the XLA H100 table, the folded duplicates agree within 1.4 % median), the
duplicates averaged. The folded points must form a full grid over (m, n, k). Between grid points the
rate is trilinear in log2 of each dimension: piecewise linear, so it never leaves the range of the
points around it. Past the largest point of a dimension the rate stays at the edge (the tiles
already fill every SM several times); below the smallest it falls in proportion (a GEMM narrower
than the smallest measured still costs that one's time: one partial wave of tiles).

Attention (``kind: attention``): per kernel, per direction (forward / backward), per mask (full /
causal), per head dimension, the rate at each of the table's key lengths. ``flops: causal_half``
says the publisher counted a causal kernel's FLOPs as half the full s^2 (FlashAttention papers);
autopar's traced FLOPs (torch's counter) count the full s^2, so such a causal rate is doubled on
reading. Between key lengths: linear in log2(length); below the shortest the first segment's
power law continues (fewer key tiles per query block); past the longest, the edge. Head
dimensions: linear in log2(d) between published ones, the nearest outside. A direction and mask
the table lacks -- the FlashAttention-3 paper publishes no causal backward -- is derived where the
other three are given: backward full x (forward causal / forward full) at the same length and head
dimension, i.e. the mask saves backward the share it saves forward (both skip the same tiles).
"""

from __future__ import annotations

import math
import os
from bisect import bisect_right
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from autopar.errors import ClusterError
from autopar.profile_tables import parse_number

TERA = 1e12
DIRECTIONS = ("forward", "backward")
MASKS = ("full", "causal")


@dataclass(frozen=True, kw_only=True)
class GemmTable:
    """Measured GEMM rates on a full (m, n, k) grid; ``rates[dtype]`` is flat, m-major."""

    source: str
    m: tuple[float, ...]
    n: tuple[float, ...]
    k: tuple[float, ...]
    rates: Mapping[str, tuple[float, ...]]  # FLOP/s

    def dtypes(self) -> tuple[str, ...]:
        return tuple(self.rates)

    def with_dtype(self, dtype: str, *, like: str, factor: float) -> GemmTable:
        """This table with a ``dtype`` column of ``like``'s rates times ``factor`` (a dtype the
        source did not measure, at its share of peak)."""
        scaled = tuple(r * factor for r in self.rates[like])
        return replace(self, rates={**self.rates, dtype: scaled})

    def rate(self, m: float, n: float, k: float, dtype: str = "bf16") -> float:
        """FLOP/s of an (m x k) @ (k x n) GEMM (m counting a batched GEMM's batch) in ``dtype``."""
        values = self.rates[dtype]
        (i0, i1, fm, sm), (j0, j1, fn, sn), (l0, l1, fk, sk) = (
            _bracket(self.m, m), _bracket(self.n, n), _bracket(self.k, k))
        nn, nk = len(self.n), len(self.k)

        def at(i: int, j: int, l: int) -> float:
            return values[(i * nn + j) * nk + l]

        out = 0.0
        for i, wi in ((i0, 1 - fm), (i1, fm)):
            for j, wj in ((j0, 1 - fn), (j1, fn)):
                for l, wl in ((l0, 1 - fk), (l1, fk)):
                    w = wi * wj * wl
                    if w:
                        out += w * at(i, j, l)
        return out * sm * sn * sk


@dataclass(frozen=True, kw_only=True)
class AttentionTable:
    """Published fused-attention rates: ``curves[(kernel, direction, mask)][head_dim]`` is the rate
    (FLOP/s, in torch's full-s^2 count) at each of ``sequence``'s key lengths."""

    source: str
    sequence: tuple[float, ...]
    curves: Mapping[tuple[str, str, str], Mapping[int, tuple[float, ...]]]

    def kernels(self) -> tuple[str, ...]:
        return tuple(sorted({k for k, _, _ in self.curves}))

    def rate(self, kernel: str, *, backward: bool, causal: bool, kv_tokens: float, head_dim: float) -> float:
        """FLOP/s (torch's count) of ``kernel`` with ``kv_tokens`` keys per query at ``head_dim``."""
        by_dim = self.curves[(kernel, DIRECTIONS[backward], MASKS[causal])]
        dims = sorted(by_dim)
        lo, hi, f, _ = _bracket(dims, min(max(float(head_dim), dims[0]), dims[-1]))  # the nearest outside
        at_lo = self._along_sequence(by_dim[dims[lo]], kv_tokens)
        return at_lo if lo == hi else at_lo + f * (self._along_sequence(by_dim[dims[hi]], kv_tokens) - at_lo)

    def _along_sequence(self, values: Sequence[float], kv_tokens: float) -> float:
        seq = self.sequence
        s = max(1.0, float(kv_tokens))
        if s <= seq[0]:  # the first segment's power law, continued below the shortest length
            slope = math.log(values[1] / values[0]) / math.log(seq[1] / seq[0])
            return values[0] * (s / seq[0]) ** slope
        i, j, f, _ = _bracket(seq, s)
        return values[i] + f * (values[j] - values[i])


def _bracket(grid: Sequence[float], x: float) -> tuple[int, int, float, float]:
    """(lower index, upper index, weight of the upper, scale) of ``x`` on ``grid`` in log2: inside,
    the two points around it; past the top, the top point; below the bottom, the bottom point with
    the rate scaled by x / bottom (the smallest measured GEMM's time)."""
    x = max(1.0, float(x))
    if x <= grid[0]:
        return 0, 0, 0.0, x / grid[0]
    if x >= grid[-1]:
        last = len(grid) - 1
        return last, last, 0.0, 1.0
    i = bisect_right(grid, x) - 1
    f = (math.log2(x) - math.log2(grid[i])) / (math.log2(grid[i + 1]) - math.log2(grid[i]))
    return i, i + 1, f, 1.0


def _source(data: Mapping[str, Any], where: str) -> str:
    source = data.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ClusterError(f"{where} names no source: add 'source:' saying where its figures come from "
                           "(a paper's table, a benchmark's output, 'autopar profile --device cuda')")
    return source.strip()


def _tflops(value: Any, where: str) -> float:
    v = parse_number(value, where)
    if v <= 0:
        raise ClusterError(f"{where} must be > 0 TFLOP/s, got {v:g}")
    return v * TERA


def gemm_table_from_dict(data: Any, where: str) -> GemmTable:
    """A ``kind: gemm`` table (see module docstring); every malformed part is a ClusterError."""
    if not isinstance(data, Mapping) or data.get("kind") != "gemm":
        raise ClusterError(f"{where} is not a GEMM table (kind: gemm)")
    source = _source(data, where)
    dtypes = data.get("dtypes")
    if not isinstance(dtypes, list) or not dtypes or not all(isinstance(d, str) for d in dtypes):
        raise ClusterError(f"{where}: 'dtypes' must list the dtypes of the rate columns, e.g. [bf16, fp32]")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ClusterError(f"{where}: 'rows' must list [b, m, n, k, rate per dtype] rows")
    folded: dict[tuple[float, float, float], list[list[float]]] = {}
    for r, row in enumerate(rows):
        at = f"{where} rows[{r}]"
        if not isinstance(row, list) or len(row) != 4 + len(dtypes):
            raise ClusterError(f"{at} must be [b, m, n, k, {', '.join(dtypes)}]")
        b, m, n, k = (parse_number(x, at) for x in row[:4])
        if min(b, m, n, k) < 1:
            raise ClusterError(f"{at}: b, m, n, k must be >= 1")
        folded.setdefault((b * m, n, k), []).append([_tflops(x, at) for x in row[4:]])
    ms, ns, ks = (tuple(sorted({key[a] for key in folded})) for a in range(3))
    missing = next(((m, n, k) for m in ms for n in ns for k in ks if (m, n, k) not in folded), None)
    if missing is not None:
        raise ClusterError(f"{where}: the rows do not form a full (b*m, n, k) grid; missing {missing}")
    rates = {d: tuple(sum(p[c] for p in folded[(m, n, k)]) / len(folded[(m, n, k)])
                      for m in ms for n in ns for k in ks) for c, d in enumerate(dtypes)}
    return GemmTable(source=source, m=ms, n=ns, k=ks, rates=rates)


def gemm_table_from_rows(rows: Sequence[Mapping[str, float]], dtype: str, source: str) -> GemmTable | None:
    """The GEMM table of a measured profile's ``gemm`` rows ({m, n, k, flops_per_s}), or None where
    they are not a full grid of at least two sizes per dimension (a CPU profile's squares and skinny
    shapes, kept for the roofline fit)."""
    data = {"kind": "gemm", "source": source, "dtypes": [dtype],
            "rows": [[1, r["m"], r["n"], r["k"], r["flops_per_s"] / TERA] for r in rows]}
    try:
        table = gemm_table_from_dict(data, f"measured gemm rows ({source})")
    except ClusterError:
        return None
    return table if min(len(table.m), len(table.n), len(table.k)) >= 2 else None


MEASURED_ATTENTION_KERNEL = "measured"  # the kernel a measured profile's attention rows are (autopar profile --device cuda)


def attention_table_from_rows(rows: Sequence[Mapping[str, Any]], kernel: str, source: str) -> AttentionTable | None:
    """The attention table of a measured profile's ``attention`` rows ({direction, mask, head_dim,
    kv_tokens, flops_per_s}, torch's FLOP count) as one kernel's curves, or None where they do not
    give every measured key length for each (direction, mask, head dimension) they name (a partial
    measurement keeps the published table)."""
    seqs = sorted({float(r["kv_tokens"]) for r in rows})
    by: dict[str, dict[str, dict[int, dict[float, float]]]] = {}
    for r in rows:
        by.setdefault(str(r["direction"]), {}).setdefault(str(r["mask"]), {}).setdefault(
            int(r["head_dim"]), {})[float(r["kv_tokens"])] = float(r["flops_per_s"]) / TERA
    curves: dict[str, dict[str, dict[int, list[float]]]] = {}
    for direction, masks in by.items():
        for mask, dims in masks.items():
            for dim, points in dims.items():
                if sorted(points) != seqs:
                    return None
                curves.setdefault(direction, {}).setdefault(mask, {})[dim] = [points[x] for x in seqs]
    data = {"kind": "attention", "source": source, "flops": "full", "sequence": seqs, "kernels": {kernel: curves}}
    try:
        return attention_table_from_dict(data, f"measured attention rows ({source})")
    except ClusterError:
        return None


def attention_table_from_dict(data: Any, where: str) -> AttentionTable:
    """A ``kind: attention`` table (see module docstring); every malformed part is a ClusterError."""
    if not isinstance(data, Mapping) or data.get("kind") != "attention":
        raise ClusterError(f"{where} is not an attention table (kind: attention)")
    source = _source(data, where)
    convention = data.get("flops", "full")
    if convention not in ("full", "causal_half"):
        raise ClusterError(f"{where}: 'flops' must be full (causal counted as the whole s^2) or causal_half")
    seq = data.get("sequence")
    if not isinstance(seq, list) or len(seq) < 2:
        raise ClusterError(f"{where}: 'sequence' must list at least two key lengths")
    sequence = tuple(parse_number(s, f"{where} sequence") for s in seq)
    if any(b <= a for a, b in zip(sequence, sequence[1:])) or sequence[0] < 1:
        raise ClusterError(f"{where}: 'sequence' must increase from >= 1")
    kernels = data.get("kernels")
    if not isinstance(kernels, Mapping) or not kernels:
        raise ClusterError(f"{where}: 'kernels' must map a kernel name to its forward/backward curves")
    curves: dict[tuple[str, str, str], dict[int, tuple[float, ...]]] = {}
    for kernel, directions in kernels.items():
        if not isinstance(directions, Mapping) or not set(directions) <= set(DIRECTIONS):
            raise ClusterError(f"{where} kernels.{kernel}: give 'forward' and/or 'backward'")
        for direction, masks in directions.items():
            if not isinstance(masks, Mapping) or not set(masks) <= set(MASKS):
                raise ClusterError(f"{where} kernels.{kernel}.{direction}: give 'full' and/or 'causal'")
            for mask, by_dim in masks.items():
                at = f"{where} kernels.{kernel}.{direction}.{mask}"
                if not isinstance(by_dim, Mapping) or not by_dim:
                    raise ClusterError(f"{at} must map a head dimension to its rates")
                scale = 2.0 if mask == "causal" and convention == "causal_half" else 1.0
                curve: dict[int, tuple[float, ...]] = {}
                for dim, values in by_dim.items():
                    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                        raise ClusterError(f"{at}: head dimension {dim!r} must be a positive integer")
                    if not isinstance(values, list) or len(values) != len(sequence):
                        raise ClusterError(f"{at}.{dim}: give one rate per key length ({len(sequence)})")
                    curve[dim] = tuple(scale * _tflops(v, f"{at}.{dim}") for v in values)
                curves[(str(kernel), direction, mask)] = curve
    for kernel in {k for k, _, _ in curves}:
        _derive_causal_backward(curves, kernel)
        if (kernel, "forward", "full") not in curves and (kernel, "forward", "causal") not in curves:
            raise ClusterError(f"{where} kernels.{kernel}: no forward curve")
    return AttentionTable(source=source, sequence=sequence, curves=curves)


def _derive_causal_backward(curves: dict[tuple[str, str, str], dict[int, tuple[float, ...]]], kernel: str) -> None:
    """Fill a missing direction/mask pair from the other three (module docstring); a pair that
    still lacks a curve falls back to its sibling mask (the same kernel at the other mask)."""
    fwd_full, fwd_causal = curves.get((kernel, "forward", "full")), curves.get((kernel, "forward", "causal"))
    bwd_full, bwd_causal = curves.get((kernel, "backward", "full")), curves.get((kernel, "backward", "causal"))
    if bwd_causal is None and bwd_full and fwd_full and fwd_causal:
        dims = sorted(set(bwd_full) & set(fwd_full) & set(fwd_causal))
        if dims:
            curves[(kernel, "backward", "causal")] = {
                d: tuple(b * c / f for b, c, f in zip(bwd_full[d], fwd_causal[d], fwd_full[d])) for d in dims}
    for direction in DIRECTIONS:
        for mask, other in (("full", "causal"), ("causal", "full")):
            if (kernel, direction, mask) not in curves and (kernel, direction, other) in curves:
                curves[(kernel, direction, mask)] = curves[(kernel, direction, other)]
    for mask in MASKS:  # no backward at all: the forward's rates
        if (kernel, "backward", mask) not in curves and (kernel, "forward", mask) in curves:
            curves[(kernel, "backward", mask)] = curves[(kernel, "forward", mask)]


def resolve_table_path(ref: str, profile_dirs: Sequence[Path]) -> Path:
    """A ``kernels:`` reference: a path to a .yaml, or NAME looked up as ``kernels/NAME.yaml``
    under each profile directory in turn (the profile's own first)."""
    p = Path(ref)
    if p.suffix in (".yaml", ".yml") or os.sep in ref:
        for base in ([Path()] if p.is_absolute() else [*profile_dirs, Path()]):
            if (base / p).is_file():
                return base / p
        raise ClusterError(f"kernel table {ref} does not exist")
    for d in profile_dirs:
        candidate = d / "kernels" / f"{ref}.yaml"
        if candidate.is_file():
            return candidate
    raise ClusterError(f"unknown kernel table '{ref}'; looked for kernels/{ref}.yaml beside the profiles")
