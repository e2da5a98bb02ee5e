"""A loop over positions priced as the fused scan kernel a GPU runs (graph/fused_scan.py).

On a GPU, a model whose reference code loops over positions runs one fused scan kernel instead
(Gu & Dao 2023, "Mamba", Section 3.3.2: inputs read once from HBM, the recurrence in SRAM, the
output written once; the backward recomputes the states). A region's ``RegionFit.scan`` holds what
that kernel moves, as fitted quantities; at a shape, with bw = HBM bandwidth x memory efficiency
and the vector (non-tensor-core) FP32 rate ``vector_flops_per_s``:

    compute   element-wise FLOPs / vector rate
              + each of its matrix products' FLOPs / max(its GEMM rate, vector rate)
    forward   max((in_bytes + out_bytes) / bw,  compute)      + one launch
    backward  max((2 in_bytes + out_bytes) / bw,  2 compute)  + one launch
    saved     the region's saved tensors less those only the scan made (``FitQuantity.in_scan``),
              plus the inputs it keeps that nothing else saves (``FusedScan.saves``)

where in_bytes and out_bytes are the sums of ``FusedScan.reads`` and ``writes`` at that shape.

in place of the loop's own ops (``FitOp.in_scan``). A CPU profile -- one measured by ``autopar
profile --device cpu``, whose ``measured.device.type`` is cpu -- keeps the loop as traced: a CPU
really runs the reference loop (``autopar run`` and the closed-loop validation on CPU execute it),
so there each op keeps its own price.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.graph.scaling import FitQuantity, FusedScan, RegionFit, Shape

# Dense bf16 tensor-core FLOP/s over vector (CUDA-core) FP32 FLOP/s: 312 / 19.5 = 16 on an A100
# SXM, 989 / 67 = 14.8 on an H100 SXM (NVIDIA data sheets). The scan's element-wise work (exp,
# multiply-adds of the recurrence) runs on the vector units.
TENSOR_TO_VECTOR_RATIO = 16.0


def runs_fused_scan(cluster: "Cluster") -> bool:
    """Whether ``cluster`` runs a loop over positions as the fused scan: as its ``software.fused_scan``
    says, else every profile but one measured on a CPU (module docstring)."""
    if cluster.fused_scan is not None:
        return cluster.fused_scan
    measured = cluster.measured
    return not (measured is not None and str(measured.device.get("type", "")).lower() == "cpu")


def vector_flops_per_s(cluster: "Cluster") -> float:
    """FP32 FLOP/s of the GPU's vector units, from its tensor-core peak (``TENSOR_TO_VECTOR_RATIO``)."""
    return cluster.peak_flops / TENSOR_TO_VECTOR_RATIO


def _total(quantities: "tuple[FitQuantity, ...]", shape: "Shape") -> float:
    return sum(q.nbytes * shape.scale(q.exps) for q in quantities)


def scan_times_s(fit: "RegionFit", cluster: "Cluster", shape: "Shape") -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's fused scan of ``fit`` at ``shape`` (module
    docstring)."""
    scan = fit.scan
    assert scan is not None
    read, write = _total(scan.reads, shape), _total(scan.writes, shape)
    rate = vector_flops_per_s(cluster)
    compute = scan.flops * shape.scale(scan.flops_exps) / rate
    for op in fit.ops:  # its matrix products, each at its own GEMM rate or the vector rate
        if op.in_scan and op.phase == "fwd" and op.kind == "gemm" and op.dims is not None and op.dims_exps:
            batch, m, n, k = (d * shape.scale(e) for d, e in zip(op.dims, op.dims_exps))
            gemm = cluster.gemm_flops_per_s(max(1.0, batch * m), max(1.0, n), max(1.0, k))
            compute += op.flops * shape.scale(op.flops_exps) / max(gemm, rate)
    bw = cluster.memory_bandwidth_bytes_per_s * cluster.memory_efficiency
    fwd = max((read + write) / bw, compute) + cluster.kernel_overhead_s
    bwd = max((2 * read + write) / bw, 2 * compute) + cluster.kernel_overhead_s
    return fwd, bwd


def scan_saved_bytes(scan: "FusedScan", shape: "Shape") -> float:
    """Bytes the fused scan saves for backward beyond what the region's other ops save."""
    return _total(scan.saves, shape)
