"""Per-region compute time and activation bytes at a given shape, from the measured op tables.

Each op's time is physics, judged on its own shape:

    GEMM       flops / rate(m, n, k)                     (m counts a batched GEMM's batch)
    attention  flops / rate(s_kv, head dim, mask, pass)  (fused flash kernel; s_kv keys per query)
    other      bytes moved / (HBM bandwidth * memory_eff) (element-wise, norms, softmax, dropout)

where a rate is the profile's kernel table at that shape (autopar.kernel_tables: measured or
published, per GPU and kernel) or, without one, peak x an efficiency curve (GEMM: ``gemm_eff(m, n,
k)``; attention: ``max * s_kv / (s_kv + half_seq)``): ``Cluster.gemm_flops_per_s`` and
``Cluster.attention_flops_per_s``.

A weight-gradient-sized backward copy (autograd's gradient accumulation) moves its bytes once per
micro-batch at any batch size, and nothing where the software fuses the accumulation into the
weight-gradient GEMM (``software.fused_grad_accumulation``, Megatron's main-grad buffer).

plus a fixed per-kernel overhead. Attention-core ops (s^2 quantities, or the fused attention kernel)
are evaluated at ``core_shape``, which differs from ``shape`` under context parallelism: a ring or
all-gather rank computes its s/cp queries against all s keys; a Ulysses rank computes all s queries
for heads/(tp*cp) heads.

Measured tables (``graph_region_time``): when the cluster carries a layer table measured for this
model file (same sha256) and dtype, a region's forward/backward time and saved bytes are the
measured ones at the nearest measured shape (interpolated, autopar.profile_tables), times the
roofline ratio of the asked shape to that measured shape. The ratio is exactly 1 at a measured
(b, s, tp) without CP or SP, so measured points are reproduced exactly; it carries what one
device cannot measure (a CP rank's queries against all keys, SP-divided norms, shapes outside the
measured grid). The edges (pre, post, loss) are looked up the same way: a table with
``edges_replicated: false`` holds one tp rank's vocabulary shard of them at each measured tp, so
at tp > 1 the measured sharded point is used as measured; a tp it lacks is the nearest measured
tp times the roofline ratio. For a table with ``edges_replicated: true`` (edges timed whole at
tp = 1 only) the caller asks at tp = 1 (autopar.cost.stage). A table for another model file or
dtype is ignored (``measured_table_warning``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from autopar.cluster import Cluster
from autopar.cost.fused_elementwise import FusedTraffic, block_traffic, fused_times_s
from autopar.cost.fused_scan import runs_fused_scan, scan_saved_bytes, scan_times_s, vector_flops_per_s
from autopar.cost.memo import IdentityMemo
from autopar.graph.scaling import GRADS_PARTS, FitOp, FitQuantity, RegionFit, Shape
from autopar.profile_tables import LayerTable
from autopar.recompute_ops import COUNTED_GEMMS, SAVED_ATTENTION, saves_gemm

if TYPE_CHECKING:
    from autopar.graph.model_graph import ModelGraph


@dataclass(frozen=True, kw_only=True)
class RegionTime:
    """One region, one micro-batch, on one rank."""

    fwd_s: float
    bwd_s: float
    core_fwd_s: float  # forward time of the attention core: what selective recompute re-runs
    core_bwd_s: float = 0.0  # backward time of the attention core (the window TE's ring P2P hides behind)
    bwd_gemm_s: float  # backward GEMM time: the window in which backward collectives can hide
    fwd_gemm_s: float = 0.0  # forward GEMM time: the window TP communication overlap hides forward collectives in
    fwd_flops: float
    bwd_flops: float
    saved_bytes: float  # activations kept for backward without recompute
    core_saved_bytes: float  # the attention-core part of saved_bytes (selective recompute drops it)
    peak_bytes: float = 0.0  # how far the live tensors rise above the saved ones here (RegionFit.peaks)
    # the same with the region's parameter gradients counted from their creation to its backward's end
    # (what an FSDP2 unit holds in the training dtype until its post-backward; graph/live.py's Tg)
    # (less, in backward, the saved activations it has freed by then: Tg')
    peak_with_grads_bytes: float = 0.0
    # peak_bytes less, in backward, the saved activations freed by then (graph/live.py's T'): the
    # rise above the saved activations the region held when its backward began
    peak_credited_bytes: float = 0.0
    fwd_peak_bytes: float = 0.0  # forward's T alone
    fwd_rise_bytes: float = 0.0  # forward's R (graph/live.py): its peak beside the region's whole saved set
    bwd_grads_bytes: float = 0.0  # the region's gradients at Tg''s peak, whichever phase peaks
    # Tg''s candidates (its peak op and its envelope's others) as (temporaries less the saved
    # activations freed by then, the region's gradients made by then): ``peak_with_grads`` re-picks
    # among them where a rank makes only a share of the gradients (E / ep experts')
    grads_candidates: tuple[tuple[float, float], ...] = ()
    # Per-op selective recompute (autopar.recompute_ops): the outputs it keeps of the ops it saves,
    # and those ops' forward time, which its recompute does not re-run.
    op_saved_bytes: float = 0.0
    # measured at a context-parallel point of the profile's table (the executor's cp attention as it
    # ran): its saved bytes are the cp kernels' own (cost.stage._cp_flash_core leaves them)
    measured_cp: bool = False
    op_saved_fwd_s: float = 0.0
    # saved_bytes and core_saved_bytes as CUDA's autocast over fp32 parameters keeps them (DDP, one
    # unwrapped rank: graph/cuda_autocast.py); ``under_autocast`` swaps them in
    autocast_saved_bytes: float = 0.0
    autocast_core_saved_bytes: float = 0.0

    @property
    def peak_grads_bytes(self) -> float:
        """Of ``peak_with_grads_bytes``, the gradients: the backward's where Tg' tops forward's peak."""
        return self.bwd_grads_bytes if self.peak_with_grads_bytes > max(0.0, self.fwd_rise_bytes) else 0.0


def is_core(op: FitOp) -> bool:
    return op.kind == "attn" or op.flops_exps.quadratic or op.bytes_exps.quadratic


def is_parameter_sized(op: FitOp, sequence_model: bool) -> bool:
    """A backward element-wise op whose bytes do not scale with the tokens of a sequence model: it
    works on a weight-shaped tensor (autograd's gradient accumulation / layout copy of a weight
    gradient). Its bytes do not depend on the micro-batch either -- its fitted batch exponent is not
    reliable, as autograd runs such copies at some batch sizes and not at others."""
    return sequence_model and op.kind == "mem" and op.phase == "bwd" and op.bytes_exps.s < 0.25


def op_time_s(op: FitOp, shape: Shape, cluster: Cluster, seq_len: int = 0,
              parameter_sized: bool = False) -> tuple[float, float]:
    """(seconds, flops) of one op at ``shape``; ``seq_len``: the graph's base sequence (attention's
    key length is ``shape.kv_ratio * seq_len``); ``parameter_sized``: see ``is_parameter_sized``."""
    if op.kind == "gemm" and op.dims is not None and op.dims_exps is not None:
        plain = _no_sp(shape)  # once: a new Shape per call when sp > 1
        flops = op.flops * plain.scale(op.flops_exps)
        return flops / _gemm_rate(op, plain, cluster) + cluster.kernel_overhead_s, flops
    if op.kind == "attn":
        flops = op.flops * shape.scale(op.flops_exps)
        return _attention_s(op, shape, cluster, flops, _key_length(op, shape, seq_len)), flops
    if parameter_sized:
        if cluster.fused_grad_accumulation:  # the weight-gradient GEMM accumulates in place
            return 0.0, 0.0
        return op.bytes * _shape_with(shape, b=1.0).scale(op.bytes_exps) / (
            cluster.memory_bandwidth_bytes_per_s * cluster.memory_efficiency) + cluster.kernel_overhead_s, 0.0
    moved = op.bytes * shape.scale(op.bytes_exps)
    flops = op.flops * shape.scale(op.flops_exps)
    bw = cluster.memory_bandwidth_bytes_per_s * cluster.memory_efficiency
    seconds = moved / bw
    if flops > 0 and op.dims is not None and op.dims_exps is not None:
        # a convolution (graph/trace.py CONV_OPS): its FLOPs at its implicit GEMMs' rate, where that
        # takes longer than its traffic (the roofline: never faster than its FLOPs allow); a grouped
        # one of a few channels per group (depthwise) runs on the vector units, not as tiny GEMMs
        seconds = max(seconds, flops / max(_gemm_rate(op, _no_sp(shape), cluster), vector_flops_per_s(cluster)))
    return seconds + cluster.kernel_overhead_s, flops


def _gemm_rate(op: FitOp, plain: Shape, cluster: Cluster) -> float:
    """FLOP/s of ``op``'s GEMM (its dims: batch, m, n, k) at ``plain`` (a shape without SP)."""
    batch, m, n, k = (d * plain.scale(e) for d, e in zip(op.dims, op.dims_exps))
    return cluster.gemm_flops_per_s(max(1.0, batch * m), max(1.0, n), max(1.0, k))


def _attention_s(op: FitOp, shape: Shape, cluster: Cluster, flops: float, keys: float) -> float:
    """Seconds of a fused attention op of ``flops`` (torch's count: every query against all
    ``keys``) at ``shape``. A ring or all-gather context-parallel rank (``kv_ratio / s_ratio`` = cp
    > 1) of a causal model runs it as pieces, each a flash kernel at the piece's own key length
    (shorter keys run slower, a causal piece at its own rate):

    * ``chunks`` (autopar run, executor/parallel/ring_attention.py): the sequence in 2 cp chunks of
      c = s / (2 cp), a rank holding chunks r and 2 cp - 1 - r; its two query chunks meet 2 cp - 1
      earlier chunks full and themselves causal: 2 cp - 1 full and 2 causal c x c pieces (where
      2 cp does not divide s, contiguous shards of n = s / cp: the last rank's cp - 1 full and one
      causal n x n piece);
    * ``transformer_engine`` (Megatron-Core's P2P ring, TE AttnFuncWithCPAndKVP2P): one causal
      piece of the rank's 2 c queries against its own 2 c keys, then cp - 1 full pieces of 2 c
      queries against c keys (the ring's step waits for the slowest rank, whose pieces are these).

    A piece of q queries and k keys counts q k of the whole op's (s / cp) s."""
    head_dim = op.dims[3] if op.dims else 0.0
    backward = op.phase == "bwd"

    def rate(kv: float, causal: bool) -> float:
        return cluster.attention_flops_per_s(kv, head_dim=head_dim, causal=causal, backward=backward)

    cp = round(shape.kv_ratio / shape.s_ratio) if shape.s_ratio > 0 else 1
    if cp < 2 or not op.causal:
        return flops / rate(keys, op.causal) + cluster.kernel_overhead_s
    unit = flops / (keys / cp * keys)  # per query-key pair
    tokens = int(round(keys))
    if cluster.cp_attention == "transformer_engine":
        c = keys / (2 * cp)
        pieces = [(2 * c, 2 * c, True)] + [(2 * c, c, False)] * (cp - 1)
    elif tokens % (2 * cp) == 0:
        c = keys / (2 * cp)
        pieces = [(c, c, False)] * (2 * cp - 1) + [(c, c, True)] * 2
    else:
        n = keys / cp
        pieces = [(n, n, False)] * (cp - 1) + [(n, n, True)]
    return sum(unit * q * k / rate(k, causal) + cluster.kernel_overhead_s for q, k, causal in pieces)


def _key_length(op: FitOp, shape: Shape, seq_len: int) -> float:
    """Keys per query of a fused attention op at ``shape``: as traced, scaled with the sequence where
    the fit says it grows with it (``kv_ratio``: under context parallelism every query still meets
    the whole sequence's keys); image patches (a ViT's, CLIP's) and a fixed-length encoder output
    (Whisper's cross-attention) keep their traced length. Graphs traced before attention recorded
    its shape: the model's sequence."""
    if op.dims is None or op.dims_exps is None:
        return shape.kv_ratio * seq_len
    return op.dims[2] * shape.kv_ratio ** op.dims_exps[2].s


def _no_sp(shape: Shape) -> Shape:
    # GEMMs inside the TP region see the gathered sequence: SP does not shrink them.
    return shape if shape.sp == 1.0 else _shape_with(shape, sp=1.0)


def _shape_with(shape: Shape, **changes: float) -> Shape:
    """``dataclasses.replace`` of a Shape, remembered: the search asks for the same few shapes
    hundreds of thousands of times (replace itself was a tenth of a 65,536-GPU search)."""
    key = (shape, tuple(sorted(changes.items())))
    hit = _SHAPES.get(key)
    if hit is None:
        if len(_SHAPES) > 100_000:
            _SHAPES.clear()
        hit = _SHAPES[key] = replace(shape, **changes)
    return hit


_SHAPES: dict[tuple, Shape] = {}


# Per fit and cluster object (autopar.cost.memo: hashing the cluster profile itself on every call
# cost more than the lookup saved).
_REGION_TIMES: IdentityMemo[RegionTime] = IdentityMemo(200_000)


def region_time(fit: RegionFit, cluster: Cluster, shape: Shape, core_shape: Shape | None = None,
                seq_len: int = 0, fused: FusedTraffic | None = None) -> RegionTime:
    """Compute time and saved bytes of ``fit`` at ``shape`` (cached); ``seq_len`` as in ``op_time_s``;
    ``fused``: the block's element-wise work as fused kernels move it (autopar.cost.fused_elementwise),
    in place of the fit's own element-wise ops."""
    core_shape = core_shape or shape
    return _REGION_TIMES.get((fit, cluster), (shape, core_shape, seq_len, fused),
                             lambda: _region_time(fit, cluster, shape, core_shape, seq_len, fused))


def op_saved(op: FitOp, gemms_before: int, shape: Shape, core_shape: Shape) -> float | None:
    """Bytes per-op selective recompute keeps of forward op ``op`` (None: it recomputes it);
    ``gemms_before``: counted GEMMs earlier in the block's forward. A GEMM's output is evaluated
    without SP's division (inside the TP region it holds the gathered sequence, or the partial sum
    a row-parallel layer reduce-scatters), the attention kernel's at ``core_shape``."""
    if op.name in COUNTED_GEMMS:
        if not saves_gemm(gemms_before + 1):
            return None
        where = _no_sp(shape)
    elif op.name in SAVED_ATTENTION:
        where = core_shape
    else:
        return None
    return op.out_bytes * where.scale(op.out_exps) if op.out_exps is not None else 0.0


def _region_time(fit: RegionFit, cluster: Cluster, shape: Shape, core_shape: Shape, seq_len: int,
                 fused: FusedTraffic | None) -> RegionTime:
    fwd = bwd = core = core_b = fwd_f = bwd_f = bwd_gemm = fwd_gemm = op_bytes = op_s = 0.0
    gemms = 0
    sequence_model = any(op.bytes_exps.s > 0.5 for op in fit.ops)
    if fused is not None:
        fwd, bwd = fused_times_s(fused, cluster, shape, seq_len)
    scan = fit.scan if fit.scan is not None and runs_fused_scan(cluster) else None
    if scan is not None:  # the loop over positions as one fused kernel (autopar.cost.fused_scan)
        scan_fwd, scan_bwd = scan_times_s(fit, cluster, shape)
        fwd, bwd = fwd + scan_fwd, bwd + scan_bwd
    for op in fit.ops:
        if scan is not None and op.in_scan:  # priced above; its FLOPs still count
            flops = op.flops * (_no_sp(shape) if op.kind == "gemm" else shape).scale(op.flops_exps)
            fwd_f, bwd_f = (fwd_f + flops, bwd_f) if op.phase == "fwd" else (fwd_f, bwd_f + flops)
            continue
        core_op = is_core(op)
        parameter_sized = is_parameter_sized(op, sequence_model)
        if fused is not None and op.kind == "mem" and not core_op and not parameter_sized:
            continue  # priced as the fused kernels above
        secs, flops = op_time_s(op, core_shape if core_op else shape, cluster, seq_len, parameter_sized)
        if op.phase == "fwd":
            fwd += secs
            fwd_f += flops
            if core_op:
                core += secs
            if op.kind == "gemm":
                fwd_gemm += secs
            kept = op_saved(op, gemms, shape, core_shape)
            gemms += op.name in COUNTED_GEMMS
            if kept is not None:
                op_bytes += kept
                op_s += secs
        else:
            bwd += secs
            bwd_f += flops
            if core_op:
                core_b += secs
            if op.kind == "gemm":
                bwd_gemm += secs
    saved = core_saved = auto = auto_core = 0.0
    # Sequence parallelism as DTensor runs it (torchtitan, the executor): a column-parallel Linear
    # saves its input after the all-gather, at the full sequence; Megatron-LM saves the shard and
    # gathers it again in backward (``sp_saves_gathered_input: false``; Megatron-Core's activations:
    # cost/megatron_memory.py).
    gathered = _no_sp(shape) if cluster.sp_saves_gathered_input and cluster.activation_memory != "megatron" else shape
    for q in fit.saved:
        if scan is not None and q.in_scan:
            continue  # only the loop made it: the fused scan keeps its inputs instead (below)
        if q.exps.quadratic:
            b = q.nbytes * core_shape.scale(q.exps)
            core_saved += b
        elif q.gemm_input and q.exps.replicated:
            b = q.nbytes * gathered.scale(q.exps)
        else:
            b = q.nbytes * shape.scale(q.exps)
        saved += b
        auto += b * q.autocast_factor
        if q.exps.quadratic:
            auto_core += b * q.autocast_factor
    if scan is not None:
        scan_saved = scan_saved_bytes(scan, shape)
        saved += scan_saved
        auto += scan_saved
    peak = max((q.nbytes * shape.scale(q.exps) for q in fit.peaks if q.what == "peak"), default=0.0)
    fwd_peak = max((q.nbytes * shape.scale(q.exps) for q in fit.peaks if q.what == "peak" and q.phase == "fwd"),
                   default=0.0)
    tails = {what: sum(q.nbytes * shape.scale(q.exps) for q in fit.peaks
                       if q.phase == "bwd" and q.what == what and q.candidate == 0)
             for what in ("peak_credit_temps", "peak_credit")}
    # T' and Tg' (graph/live.py): backward's peak less the saved activations freed by then (each
    # part by its own law); forward's as T. Tg' at this shape: the largest of its envelope's ops
    candidates = _grads_candidates(fit.peaks, shape)
    grads_temps, grads, grads_credit = max(candidates, key=lambda v: v[0] + v[1] - v[2], default=(0.0, 0.0, 0.0))
    # beside the whole saved set, forward's peak counts by its rise R (graph/live.py): what it holds
    # there beyond the saved tensors made later in the region (a graph without R: its T)
    rises = [q for q in fit.peaks if q.phase == "fwd" and q.what in ("rise_temps", "rise_to_come")]
    rise = fwd_peak if not rises else sum(q.nbytes * shape.scale(q.exps) * (1 if q.what == "rise_temps" else -1)
                                          for q in rises)
    with_grads = max(0.0, rise, grads_temps + grads - grads_credit)
    credited = max(0.0, rise, tails["peak_credit_temps"] - tails["peak_credit"])
    return RegionTime(fwd_s=fwd, bwd_s=bwd, core_fwd_s=core, core_bwd_s=core_b, bwd_gemm_s=bwd_gemm, fwd_gemm_s=fwd_gemm,
                      fwd_flops=fwd_f, bwd_flops=bwd_f,
                      saved_bytes=saved, core_saved_bytes=core_saved, peak_bytes=peak,
                      peak_with_grads_bytes=with_grads, peak_credited_bytes=credited,
                      fwd_peak_bytes=fwd_peak, fwd_rise_bytes=rise, bwd_grads_bytes=grads,
                      grads_candidates=tuple((t - c, g) for t, g, c in candidates),
                      op_saved_bytes=op_bytes, op_saved_fwd_s=op_s,
                      autocast_saved_bytes=auto, autocast_core_saved_bytes=auto_core)


def _grads_candidates(peaks: tuple[FitQuantity, ...], shape: Shape) -> list[tuple[float, float, float]]:
    """Tg''s (temporaries, gradients, credit) at ``shape`` for each backward op the trace fitted
    (its peak and its envelope's others, graph/scaling.py ``candidate``)."""
    parts: dict[int, list[float]] = {}
    for q in peaks:
        if q.phase == "bwd" and q.what in GRADS_PARTS:
            parts.setdefault(q.candidate, [0.0, 0.0, 0.0])[GRADS_PARTS.index(q.what)] += q.nbytes * shape.scale(q.exps)
    return [(t, g, c) for t, g, c in parts.values()]


def peak_with_grads(rt: RegionTime, grads_share: float = 1.0) -> tuple[float, float]:
    """(``peak_with_grads_bytes``, ``peak_grads_bytes``) of ``rt`` where a rank makes ``grads_share``
    of the region's parameter gradients (expert parallelism: its dense ones and E / ep experts').
    The backward op that peaks is picked again at that share: the op where a block's whole
    gradients top its temporaries (the end of its backward, its activations freed) can fall below
    an earlier one once most of those gradients are another rank's -- Mixtral-8x7B at ep 8 priced
    its block's backward at nothing and rehearsed 0.5 GiB above it."""
    if grads_share >= 1.0 or not rt.grads_candidates:
        return rt.peak_with_grads_bytes, rt.peak_grads_bytes
    rest, grads = _picked(rt, grads_share)
    floor = max(0.0, rt.fwd_rise_bytes)
    top = rest + grads
    return max(floor, top), grads if top > floor else 0.0


def bwd_grads_at(rt: RegionTime, grads_share: float = 1.0) -> float:
    """``bwd_grads_bytes`` where a rank makes ``grads_share`` of the region's gradients: those made
    by the backward op that peaks at that share (``peak_with_grads``), whichever phase peaks."""
    if grads_share >= 1.0 or not rt.grads_candidates:
        return rt.bwd_grads_bytes
    return _picked(rt, grads_share)[1]


def _picked(rt: RegionTime, grads_share: float) -> tuple[float, float]:
    """(temporaries less credit, gradients at ``grads_share``) of the candidate that peaks there."""
    rest, grads = max(rt.grads_candidates, key=lambda v: v[0] + v[1] * grads_share)
    return rest, grads * grads_share


def under_autocast(rt: RegionTime) -> RegionTime:
    """``rt`` with the activations CUDA's autocast over fp32 parameters keeps (graph/cuda_autocast.py):
    the residual stream and what the fp32 list computes in fp32, a 16-bit copy per GEMM of an fp32
    input; per-op recompute's kept outputs by the region's ratio."""
    ratio = rt.autocast_saved_bytes / rt.saved_bytes if rt.saved_bytes > 0 else 1.0
    return replace(rt, saved_bytes=rt.autocast_saved_bytes, core_saved_bytes=rt.autocast_core_saved_bytes,
                   op_saved_bytes=rt.op_saved_bytes * ratio)


def usable_layer_table(graph: "ModelGraph", cluster: Cluster) -> LayerTable | None:
    """The cluster's measured layer table if it was measured for this model file and dtype."""
    m = cluster.measured
    if m is None or m.layers is None or measured_table_warning(graph, cluster) is not None:
        return None
    return m.layers


def measured_table_warning(graph: "ModelGraph", cluster: Cluster) -> str | None:
    """Why a measured layer table present in ``cluster`` is not used for ``graph`` (None: it is, or none)."""
    m = cluster.measured
    if m is None or m.layers is None:
        return None
    t = m.layers
    if t.model_sha256 != graph.sha256:
        return (f"the profile's layer table was measured for {t.model_name or 'another model'} (sha256 "
                f"{t.model_sha256[:12]}), not {graph.name} ({graph.sha256[:12]}); layer times use the roofline")
    if t.dtype != graph.dtype:
        return f"the profile's layer table was measured in {t.dtype}, the plan trains in {graph.dtype}; layer times use the roofline"
    return None


def graph_region_time(graph: "ModelGraph", region: str, cluster: Cluster, shape: Shape,
                      core_shape: Shape | None = None, cp: int = 1, cp_kind: str = "") -> RegionTime:
    """``region_time`` of ``graph.regions[region]``, from measured tables when they apply (see the
    module docstring). ``cp``/``cp_kind``: the block of a context-parallel rank; a table with
    points measured for that kind (the executor's cp attention on a loopback) is used as measured,
    else the plain s/cp points times the roofline ratio."""
    fit = graph.regions[region]
    fused = block_traffic(graph) if region == "block" and cluster.fused_elementwise else None
    rt = region_time(fit, cluster, shape, core_shape, graph.seq_len, fused)
    table = usable_layer_table(graph, cluster)
    if table is None:
        return rt
    S = graph.seq_len
    s_tokens = shape.s_ratio * S
    hit = table.lookup(region, shape.b, s_tokens, int(round(shape.t)), cp, cp_kind)
    if hit is None:
        return rt
    ratio_s = hit.s / S
    ref_shape = Shape(b=hit.b, s_ratio=ratio_s, kv_ratio=ratio_s * hit.cp, t=float(hit.tp), sp=1.0)
    ref_core = None
    if hit.cp > 1 and hit.cp_kind == "ulysses":  # all s queries, heads / (tp cp)
        ref_core = Shape(b=hit.b, s_ratio=ratio_s * hit.cp, kv_ratio=ratio_s * hit.cp, t=float(hit.tp * hit.cp), sp=1.0)
    ref = region_time(fit, cluster, ref_shape, ref_core, graph.seq_len, fused)
    v = hit.values

    def scaled(measured: float, ours: float, at_ref: float) -> float:
        return measured * ours / at_ref if at_ref > 0 else measured

    fwd = scaled(v["fwd_s"], rt.fwd_s, ref.fwd_s)
    bwd = scaled(v["bwd_s"], rt.bwd_s, ref.bwd_s)
    saved = scaled(v["saved_bytes"], rt.saved_bytes, ref.saved_bytes) if v["saved_bytes"] > 0 else rt.saved_bytes
    f_ratio = fwd / rt.fwd_s if rt.fwd_s > 0 else 1.0
    b_ratio = bwd / rt.bwd_s if rt.bwd_s > 0 else 1.0
    s_ratio = saved / rt.saved_bytes if rt.saved_bytes > 0 else 1.0
    # The core's own measured forward when the table has it (what selective recompute re-runs);
    # else the roofline's share of the measured block forward.
    core = (scaled(v["core_fwd_s"], rt.core_fwd_s, ref.core_fwd_s) if "core_fwd_s" in v and rt.core_fwd_s > 0
            else rt.core_fwd_s * f_ratio)
    return replace(rt, fwd_s=fwd, bwd_s=bwd, core_fwd_s=core, core_bwd_s=rt.core_bwd_s * b_ratio,
                   bwd_gemm_s=rt.bwd_gemm_s * b_ratio,
                   fwd_gemm_s=rt.fwd_gemm_s * f_ratio,
                   saved_bytes=saved, core_saved_bytes=rt.core_saved_bytes * s_ratio,
                   autocast_saved_bytes=rt.autocast_saved_bytes * s_ratio,
                   autocast_core_saved_bytes=rt.autocast_core_saved_bytes * s_ratio,
                   op_saved_bytes=rt.op_saved_bytes * s_ratio, op_saved_fwd_s=rt.op_saved_fwd_s * f_ratio,
                   measured_cp=hit.cp > 1)
