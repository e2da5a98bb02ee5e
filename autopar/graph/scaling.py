"""Turn traces measured at a few shapes into quantities evaluable at any shape.

Each region (embedding, one transformer block, head, loss) is traced at four shapes: the base
(micro-batch 1, sequence S, tensor-parallel degree 1) and one change at a time: micro-batch 2,
sequence S/2, and the block's Linear layers sharded for tp = 2. For every op, saved tensor and
collective, matched by position across the four traces, we read off its exponent in each variable:

    value(b, s, t) = value_base * b^e_b * (s / S)^e_s * t^(-e_t)

e_s = 2 marks the attention core (scores, softmax: what selective recompute drops); e_t = 0 marks
what tensor parallelism replicates (what Megatron sequence parallelism divides instead); GEMM
dimensions get the same treatment so the efficiency of each GEMM is judged on its real shape.
This is measurement, not a formula: the exponents come out exact for transformer blocks (every
quantity is a monomial in b, s and 1/t) and the fit is checked on the traces it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from autopar.graph.align import matching_blocks
from autopar.graph.records import OpRecord, SavedRecord, Trace

QUADRATIC_EXPONENT = 1.5  # e_s above this: an attention-core quantity (s^2)


@dataclass(frozen=True, kw_only=True)
class Exps:
    """Exponents of one quantity in micro-batch, sequence length and 1/tp."""

    b: float = 1.0
    s: float = 1.0
    t: float = 0.0

    @property
    def quadratic(self) -> bool:
        return self.s > QUADRATIC_EXPONENT

    @property
    def replicated(self) -> bool:
        """Not divided by tensor parallelism, but proportional to tokens (SP can divide it)."""
        return abs(self.t) < 0.25 and self.b > 0.5


@dataclass(frozen=True, kw_only=True)
class Shape:
    """Where to evaluate: micro-batch, query/key sequence per rank, and head/width division."""

    b: float
    s_ratio: float  # local query tokens / S
    kv_ratio: float  # key/value tokens seen by attention / S (== s_ratio without CP)
    t: float  # division of TP-sharded quantities (tp, or tp*cp inside Ulysses attention)
    sp: float = 1.0  # extra division of replicated token-proportional quantities (tp under SP)

    def scale(self, e: Exps) -> float:
        if e.quadratic:
            seq = self.s_ratio * self.kv_ratio ** (e.s - 1.0)
        else:
            seq = self.s_ratio**e.s
        out = self.b**e.b * seq * self.t ** (-e.t)
        if e.replicated:
            out /= self.sp
        return out


@dataclass(frozen=True, kw_only=True)
class FitOp:
    phase: str
    kind: str
    flops: float
    flops_exps: Exps
    bytes: float
    bytes_exps: Exps
    dims: tuple[int, int, int, int] | None
    dims_exps: tuple[Exps, Exps, Exps, Exps] | None
    name: str = ""  # the aten op (e.g. native_dropout: a memory model counts its masks)
    out_bytes: float = 0.0  # bytes it returns (records.OpRecord.out_bytes) and their exponents
    out_exps: Exps | None = None
    causal: bool = False  # a fused attention op with is_causal (records.OpRecord.causal)
    # An op of a region whose op count changes with the sequence (a per-position Python loop) that has
    # no counterpart in the trace at half the sequence: it stands for the positions that trace lacks
    # (``at_longer_sequence`` repeats it for the positions a longer sequence adds)
    per_position: bool = False
    in_scan: bool = False  # one of a loop's ops that a GPU runs as one fused scan (graph/fused_scan.py)


@dataclass(frozen=True, kw_only=True)
class FitQuantity:
    """A saved tensor or a collective's message: bytes at the base shape and its exponents."""

    what: str
    phase: str
    nbytes: float
    exps: Exps
    gemm_input: bool = False  # a saved GEMM input (records.SavedRecord.gemm_input)
    autocast_factor: float = 1.0  # a saved tensor's bytes under autocast per byte (records.SavedRecord)
    in_scan: bool = False  # a tensor only a loop's scan made: its fused kernel keeps none (graph/fused_scan.py)
    # a backward peak's part: 0 the trace's own peak op, k > 0 the k-th other op of Tg''s envelope
    # (graph/live.py; cost.compute takes the candidate that peaks at the shape it prices)
    candidate: int = 0


@dataclass(frozen=True, kw_only=True)
class FusedScan:
    """The fused kernel of a region's loop over positions (graph/fused_scan.py; priced by
    autopar.cost.fused_scan): the tensors it reads and writes once, those of its inputs it saves that
    nothing else saves, and the forward FLOPs of its element-wise work, each with its exponents
    (its matrix products are its ops marked ``in_scan`` of kind gemm)."""

    reads: tuple[FitQuantity, ...]
    writes: tuple[FitQuantity, ...]
    saves: tuple[FitQuantity, ...]
    flops: float
    flops_exps: Exps


@dataclass(frozen=True, kw_only=True)
class RegionFit:
    """Everything measured about one region, evaluable at any Shape."""

    ops: tuple[FitOp, ...]
    saved: tuple[FitQuantity, ...]
    comm: tuple[FitQuantity, ...]
    # how far a step's live tensors rise above its saved activations in this region, per phase
    # (graph/live.py): the loss's full-vocabulary copies, gradients of activations
    peaks: tuple[FitQuantity, ...] = ()
    scan: FusedScan | None = None  # its loop over positions as one fused kernel (ops marked ``in_scan``)


def _exp(base: float, other: float, factor: float) -> float:
    """Exponent e with other = base * factor^e (0 when either side is 0)."""
    if base <= 0 or other <= 0:
        return 0.0
    e = math.log(other / base) / math.log(factor)
    return round(e * 4) / 4  # exponents are small rationals; rounding removes fp noise


def _exps(base: float, b2: float | None, s_half: float | None, t2: float | None) -> Exps:
    # Clamped to what a layer can physically do: at most linear in the batch and in 1/tp, at most
    # quadratic in the sequence. (A value outside means two different kernels were paired.)
    return Exps(
        b=min(1.0, max(0.0, _exp(base, b2, 2.0))) if b2 is not None else 1.0,
        s=min(2.0, max(0.0, _exp(base, s_half, 0.5))) if s_half is not None else 0.0,
        t=min(1.0, max(0.0, -_exp(base, t2, 2.0))) if t2 is not None else 0.0,
    )


def fit_output(base: Any, b2: Any, s_half: Any | None, t2: Any | None) -> FitQuantity | None:
    """The model's output (``output_bytes`` of graph/build.TracedRun: the traces at the base shape,
    micro-batch 2, half the sequence and tp 2; None where not traced) as a quantity; None where the
    forward returned no tensor."""
    if base.output_bytes <= 0:
        return None
    other = [None if run is None else run.output_bytes for run in (b2, s_half, t2)]
    return FitQuantity(what="output", phase="fwd", nbytes=base.output_bytes, exps=_exps(base.output_bytes, *other))


def _align(a: list[OpRecord], b: list[OpRecord]) -> list[OpRecord | None]:
    """For each op of ``a``, its counterpart in ``b`` (None where unmatched).

    The op sequence is usually identical across shapes; where autograd orders gradient
    accumulation differently, a sequence alignment on (phase, name) still pairs the real kernels.
    """
    key_a = [(o.phase, o.name) for o in a]
    key_b = [(o.phase, o.name) for o in b]
    out: list[OpRecord | None] = [None] * len(a)
    if key_a == key_b:
        return list(b)
    for i, j, size in matching_blocks(key_a, key_b):  # difflib's blocks, in linear time (graph/align.py)
        for k in range(size):
            out[i + k] = b[j + k]
    return out


Aligned = tuple[list[OpRecord], dict[str, "list[OpRecord | None] | None"]]


def align_region(region: str, base: Trace, b2: Trace | None, s_half: Trace | None, t2: Trace | None) -> Aligned:
    """The region's ops in ``base`` and, per varied variable ("b", "s", "t"), each one's counterpart
    in that variable's trace (None: not varied)."""
    ops = [o for o in base.ops if o.region == region]
    return ops, {key: None if trace is None else _align(ops, [o for o in trace.ops if o.region == region])
                 for key, trace in (("b", b2), ("s", s_half), ("t", t2))}


def fit_region(
    region: str,
    base: Trace,
    b2: Trace | None,
    s_half: Trace | None,
    t2: Trace | None,
    aligned: Aligned | None = None,
) -> RegionFit:
    """Fit one region's exponents from its traces (None: that variable was not varied); ``aligned``:
    ``align_region`` of the same, where the caller has it. (graph/fused_scan.fit_with_scan adds the
    region's loop over positions, if any.)"""
    ops, variants = aligned or align_region(region, base, b2, s_half, t2)
    varies = s_half is not None and len(ops) != sum(1 for o in s_half.ops if o.region == region)
    fitted = []
    for i, op in enumerate(ops):
        def other(key: str) -> OpRecord | None:
            v = variants[key]
            return None if v is None else v[i]

        def pick(key: str, attr: str) -> float | None:
            o = other(key)
            return None if o is None else getattr(o, attr)

        dims_exps = None
        if op.dims is not None:
            dims_exps = tuple(
                _exps(op.dims[d], *(None if other(k) is None or other(k).dims is None else other(k).dims[d]
                                    for k in "bst"))
                for d in range(4)
            )
        fitted.append(FitOp(
            phase=op.phase, kind=op.kind,
            flops=op.flops, flops_exps=_exps(op.flops, pick("b", "flops"), pick("s", "flops"), pick("t", "flops")),
            bytes=op.bytes, bytes_exps=_exps(op.bytes, pick("b", "bytes"), pick("s", "bytes"), pick("t", "bytes")),
            dims=op.dims, dims_exps=dims_exps, name=op.name, out_bytes=op.out_bytes,
            out_exps=_exps(op.out_bytes, pick("b", "out_bytes"), pick("s", "out_bytes"), pick("t", "out_bytes")),
            causal=op.causal, per_position=varies and other("s") is None,
        ))
    saved = _fit_saved(region, base, b2, s_half, t2)
    comm = _fit_comm(region, base, b2, s_half, t2)
    return RegionFit(ops=tuple(fitted), saved=saved, comm=comm, peaks=_fit_peaks(region, base, b2, s_half, t2))


PEAK_PARTS = (("peak", "nbytes"), ("peak_grads_temps", "grads_temps_nbytes"), ("peak_grads", "grads_nbytes"),
              ("peak_grads_credit", "grads_credit_nbytes"), ("peak_credit_temps", "credit_temps_nbytes"),
              ("peak_credit", "credit_nbytes"), ("rise_temps", "rise_temps_nbytes"), ("rise_to_come", "rise_to_come_nbytes"))


GRADS_PARTS = ("peak_grads_temps", "peak_grads", "peak_grads_credit")  # Tg''s parts, in PeakRecord.grads_states order


def _fit_peaks(region: str, base: Trace, *others: Trace | None) -> tuple[FitQuantity, ...]:
    """Each phase's peak above the saved activations (``Trace.peaks``), fitted like a saved tensor:
    T as ``peak``, Tg''s temporaries, unit gradients and credit (graph/live.py) as ``peak_grads_temps``,
    ``peak_grads`` and ``peak_grads_credit``, T''s as ``peak_credit_temps`` and ``peak_credit``, the
    forward rise R's as ``rise_temps`` and ``rise_to_come``, each
    with its own exponents (the gradients scale like the parameters, a credit like the activations).
    Tg''s other candidates in backward (``_envelope_candidates``) follow as ``candidate`` 1, 2, ..."""
    def record(trace: Trace | None, phase: str) -> Any:
        if trace is None:
            return None
        return next((p for p in trace.peaks if p.region == region and p.phase == phase), None)

    def of(trace: Trace | None, phase: str, attr: str) -> float | None:
        rec = record(trace, phase)
        return None if rec is None else getattr(rec, attr)

    out = []
    for phase in ("fwd", "bwd"):
        for what, attr in PEAK_PARTS:
            v = of(base, phase, attr)
            if v:
                out.append(FitQuantity(what=what, phase=phase, nbytes=v,
                                       exps=_exps(v, *(of(t, phase, attr) for t in others))))
    rec = record(base, "bwd")
    if rec is not None and rec.grads_states:
        out.extend(_envelope_candidates(rec, [record(t, "bwd") for t in others]))
    return tuple(out)


def _envelope_candidates(base: Any, others: list[Any]) -> list[FitQuantity]:
    """Tg''s parts at the other ops of its upper envelope in the base trace (graph/live.py): the ops
    whose (temporaries - credit, gradients) no other op beats for some nonnegative weights of the two
    -- the activation and the parameter scale -- each part fitted from the same op of the varied
    traces (paired by position where a variant ran as many backward ops; else scaled as the trace's
    peak's part)."""
    states = base.grads_states
    peak = (base.grads_temps_nbytes, base.grads_nbytes, base.grads_credit_nbytes)
    out = []
    for k, i in enumerate(i for i in _upper_envelope(states) if states[i] != peak):
        for j, (what, attr) in enumerate(zip(GRADS_PARTS, ("grads_temps_nbytes", "grads_nbytes", "grads_credit_nbytes"))):
            v = states[i][j]
            if not v:
                continue
            varied = []
            for rec in others:
                if rec is None:
                    varied.append(None)
                elif len(rec.grads_states) == len(states):
                    varied.append(rec.grads_states[i][j])
                else:
                    at_peak = getattr(base, attr)
                    varied.append(v * getattr(rec, attr) / at_peak if at_peak else None)
            exps = _exps(v, *varied)
            if varied and varied[0]:
                # anchored at two samples: the batch exponent is clamped to 1, and a part a batch of one
                # makes less of (a ViT block's output gradient) then extrapolates from two, not under it
                v = varied[0] / 2.0**exps.b
            out.append(FitQuantity(what=what, phase="bwd", nbytes=v, exps=exps, candidate=k + 1))
    return out


def _upper_envelope(states: tuple[tuple[float, float, float], ...]) -> list[int]:
    """Positions of the states (temporaries, gradients, credit) on the upper-right convex hull of
    their points (temporaries - credit, gradients): those that are the largest a x A + g x G for
    some a, g >= 0, from the most gradients to the most activations."""
    points = sorted(((t - c, g, i) for i, (t, g, c) in enumerate(states)), key=lambda p: (-p[1], -p[0]))
    hull: list[tuple[float, float, int]] = []
    for p in points:  # most gradients first; keep those that add activations, convex
        if hull and p[0] <= hull[-1][0]:
            continue
        while len(hull) >= 2:
            (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) >= 0:  # hull[-1] not above the chord
                hull.pop()
            else:
                break
        hull.append(p)
    return [i for _, _, i in hull]


# Where a variant saves a few tensors more or fewer than the base (at most this many, or a tenth):
# a mask the model builds only where the sequence reaches its attention window (HF StarCoder2's
# sliding window of 4,096 at 4,096 tokens; none at 2,048), the tensors are paired by alignment.
_ALIGN_SLACK = 2
_ALIGN_MAX_CELLS = 250_000  # the alignment is quadratic: a region of more tensors keeps the total's exponent
# The byte ratios base / variant a saved tensor can show: the batch variant doubles the batch, the
# sequence variant halves the sequence (s^0, s^1, s^2), the tp variant halves the sharded widths.
_RATIOS = ((1.0, 0.5), (1.0, 2.0, 4.0), (1.0, 2.0))


def _aligned(rows: list[SavedRecord], other: list[SavedRecord], ratios: tuple[float, ...]) -> list[int | None]:
    """For each record of ``rows``, the index of its partner in ``other`` (None: unpaired): the longest
    order-preserving pairing of records of one kind (GEMM input or not, the same autocast factor)
    whose bytes differ by one of ``ratios`` (base / variant)."""
    n, m = len(rows), len(other)

    def pairs(a: SavedRecord, b: SavedRecord) -> bool:
        if a.gemm_input != b.gemm_input or a.autocast_factor != b.autocast_factor:
            return False
        if a.nbytes <= 0 or b.nbytes <= 0:
            return a.nbytes == b.nbytes
        return any(abs(a.nbytes / b.nbytes - x) <= 1e-3 * x for x in ratios)

    longest = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            longest[i][j] = (longest[i + 1][j + 1] + 1 if pairs(rows[i], other[j])
                             else max(longest[i + 1][j], longest[i][j + 1]))
    out: list[int | None] = [None] * n
    i = j = 0
    while i < n and j < m:
        if pairs(rows[i], other[j]) and longest[i][j] == longest[i + 1][j + 1] + 1:
            out[i] = j
            i, j = i + 1, j + 1
        elif longest[i + 1][j] >= longest[i][j + 1]:
            i += 1
        else:
            j += 1
    return out


def _fit_saved(region: str, base: Trace, *others: Trace | None) -> tuple[FitQuantity, ...]:
    """Each saved tensor of ``region`` at the base shape with its exponents, paired tensor by tensor
    with the traces at the varied shapes (``others``: twice the batch, half the sequence, tp = 2).
    Where a variant saves a few tensors more or fewer (``_ALIGN_SLACK``), they are paired by
    alignment (``_aligned``); a base tensor left unpaired -- or every tensor, where a variant saves
    another number of tensors altogether (a block that loops over the sequence: a recurrent scan's
    reference kernel saves one state per step) -- takes that variable's exponent of the region's
    total saved bytes (the total is fitted exactly, its split among the tensors is the base shape's),
    except a self-attention's bias absent at half the sequence, which is quadratic in it."""
    rows = [r for r in base.saved if r.region == region]
    total = sum(r.nbytes for r in rows)
    vals: list[list[float | None]] = [[] for _ in rows]  # per row, its value in each variant
    for k, trace in enumerate(others):
        if trace is None:
            for v in vals:
                v.append(None)
            continue
        other = [r for r in trace.saved if r.region == region]
        share = float(sum(r.nbytes for r in other)) / total if total else 0.0
        if len(other) == len(rows):
            partner: list[int | None] = list(range(len(rows)))
        elif abs(len(other) - len(rows)) <= max(_ALIGN_SLACK, len(rows) // 10) \
                and len(other) * len(rows) <= _ALIGN_MAX_CELLS:
            partner = _aligned(rows, other, _RATIOS[k] if k < len(_RATIOS) else (1.0,))
        else:
            partner = [None] * len(rows)
        for i, (r, j) in enumerate(zip(rows, partner)):
            if j is not None:
                vals[i].append(other[j].nbytes)
            elif k == 1 and r.attention_bias:
                vals[i].append(r.nbytes / 4.0)  # queries x keys at half the sequence
            else:
                vals[i].append(r.nbytes * share)
    return tuple(FitQuantity(what="saved", phase="fwd", nbytes=r.nbytes, exps=_exps(r.nbytes, *v),
                             gemm_input=r.gemm_input, autocast_factor=r.autocast_factor)
                 for r, v in zip(rows, vals))


def _fit_comm(region: str, base: Trace, *others: Trace | None) -> tuple[FitQuantity, ...]:
    rows = [c for c in base.comm if c[0] == region]
    out = []
    for i, (_, phase, what, nbytes) in enumerate(rows):
        vals = []
        for trace in others:
            other = None if trace is None else [c for c in trace.comm if c[0] == region]
            vals.append(None if other is None or len(other) != len(rows) else other[i][3])
        out.append(FitQuantity(what=what, phase=phase, nbytes=nbytes, exps=_exps(nbytes, *vals)))
    return tuple(out)


def at_longer_sequence(fit: RegionFit, ratio: float) -> RegionFit:
    """``fit`` (measured at sequence s0: its base values) moved to the sequence ``ratio`` x s0, for a
    graph probed at a shorter sequence than it plans for (graph/short_probe.py). Every quantity is
    evaluated by its own sequence exponent, value x ratio^e_s, and GEMM dimensions likewise: exact
    where the fit is (a monomial in the sequence: every op's FLOPs, attention, elementwise traffic,
    saved activations); a sum of a constant and a sequence term (a GEMM's bytes: weights plus
    activations) carries its rounded exponent's error, grown by the ratio.

    An op that repeats per position (``per_position``: the s0/2 positions the half-sequence trace
    lacked) stands, at the longer sequence, for ratio x s0 - s0/2 positions instead of s0/2, each
    the size of its nearest copy with a counterpart (a loop's backward may build a sequence-long
    tensor at every position): with those copies, one per
    position of the first half, the loop counts one op per position. It stays one op of that total
    cost, not one op per position."""
    def q(v: FitQuantity) -> FitQuantity:
        return replace(v, nbytes=v.nbytes * ratio**v.exps.s)

    like = _nearest_counterparts(fit.ops)

    def op(i: int, o: FitOp) -> FitOp:
        if not o.per_position:
            return _op_at(o, o, ratio, 1.0)
        return _op_at(o, fit.ops[like[i]] if like[i] is not None else o, ratio, 2.0 * ratio - 1.0)

    scan = fit.scan
    if scan is not None:
        scan = replace(scan, reads=tuple(map(q, scan.reads)), writes=tuple(map(q, scan.writes)),
                       saves=tuple(map(q, scan.saves)), flops=scan.flops * ratio**scan.flops_exps.s)
    return RegionFit(ops=tuple(op(i, o) for i, o in enumerate(fit.ops)), saved=tuple(q(v) for v in fit.saved),
                     comm=tuple(q(v) for v in fit.comm), peaks=tuple(q(v) for v in fit.peaks), scan=scan)


def _nearest_counterparts(ops: tuple[FitOp, ...]) -> list[int | None]:
    """For each op, the index of the nearest op that is not ``per_position`` and is its copy -- the
    same phase, aten op, FLOPs, bytes and dimensions: another position of the same loop step --
    before or after it (a loop's backward runs its last positions first; the earlier on a tie),
    None where there is none."""
    out: list[int | None] = [None] * len(ops)
    for order in (range(len(ops)), range(len(ops) - 1, -1, -1)):
        seen: dict[tuple, int] = {}
        for i in order:
            o = ops[i]
            key = (o.phase, o.name, o.flops, o.bytes, o.out_bytes, o.dims)
            if not o.per_position:
                seen[key] = i
                continue
            j = seen.get(key)
            if j is not None and (out[i] is None or abs(j - i) < abs(out[i] - i)):
                out[i] = j
    return out


def _op_at(o: FitOp, like: FitOp, ratio: float, copies: float) -> FitOp:
    """``o`` at ``ratio`` times the sequence by the sequence exponents of ``like``, ``copies`` times."""
    dims = o.dims
    if o.dims is not None and like.dims_exps is not None:
        dims = tuple(int(round(d * ratio**e.s)) for d, e in zip(o.dims, like.dims_exps))
    out_s = like.out_exps.s if like.out_exps is not None else 0.0
    return replace(o, flops=o.flops * copies * ratio**like.flops_exps.s,
                   bytes=o.bytes * copies * ratio**like.bytes_exps.s,
                   out_bytes=o.out_bytes * copies * ratio**out_s, dims=dims)
