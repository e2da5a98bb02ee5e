"""A loop over positions as the fused scan kernel a GPU runs in its place.

A model written as a recurrence over positions -- Hugging Face Mamba / Jamba's reference selective
scan, an RWKV or linear-attention reference loop, a plain ``for t in range(seq)`` RNN -- runs that
loop in Python on the meta device and on CPU: one small kernel per position and step, and a
backward that may build a sequence-long gradient at every position (Jamba's ``select_backward`` of
a (d_inner x seq x state) tensor: quadratic in the sequence). On a GPU the same model calls a fused
scan instead (HF's ``cuda_kernels_forward`` with ``mamba-ssm``): Gu & Dao 2023, "Mamba", Section
3.3.2 ("hardware-aware algorithm"), load the scan's inputs once from HBM, discretise and run the
recurrence in SRAM/registers, write the output once; the backward re-reads the inputs and recomputes
the states rather than storing them. This module finds the ops of such a loop in a trace and
measures what the fused kernel moves; ``autopar.cost.fused_scan`` prices it.

Which ops are the scan (``find_scan``), by behaviour, in one region's trace:

* the loop: the ops the half-sequence trace lacks (``FitOp.per_position``) that recur at least half
  as often as the most frequent such kind (phase, name, size: ``loop_positions``), extended both
  ways by the loop step's period while an op repeats the one a step away (``_loop_around``);
* its epilogue: element-wise forward ops (no reduction, no FLOPs of their own) after the loop that
  read one of its results (stacking the per-position outputs, Mamba's ``D`` skip and ``silu(z)``
  gate, a cast);
* its prologue: element-wise forward ops whose every result only the scan reads (Mamba's delta
  bias and softplus, the discretised ``exp(delta A)`` and ``delta B u`` of shape (b, d_inner, seq,
  state) that the kernel never materialises, a state's zero init, ``silu(z)``);
* its backward: the backward loop, every backward op that reads a tensor only the scan made
  (``internal``), and memory-bound backward ops that read only such tensors, the scan's inputs and
  what the scan's backward made, one of the latter at least (the reductions of the (.., state)
  gradients to the inputs' shapes, their casts).

What the fused kernel moves (``measure``), tensor by tensor at each traced shape, each fitted like a
saved tensor (``with_scan``):

    reads      each tensor the scan reads from outside it, once: the bytes it reads of it (a tensor
               read slice by slice, one per position, counts its slices up to its own size; an op
               that takes a tensor for its shape only reads none of it)
    writes     each tensor the scan makes (or writes in place) that an op outside it reads, once
    flops      one per element its element-wise ops write (its matrix products are its GEMM ops)
    saves      its reads that no other op of the model saves (what the kernel keeps for backward)

and ``autopar.cost.fused_scan`` prices the kernel from them: forward in + out bytes, backward
2 in + out (re-read the inputs, read the output's gradient, write one gradient per input), compute
twice the forward's. For one Mamba layer that is reads = u, delta, z (b s d_inner), A (d_inner
state), B and C (b s state), D and delta's bias, writes = y (b s d_inner), at the dtypes the trace
holds them in.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Iterable

from autopar.graph.records import OpRecord, Trace
from autopar.graph.scaling import FitQuantity, FusedScan, RegionFit, _exps, align_region, fit_region

MIN_POSITIONS = 2  # a kind of op that repeats fewer times than this is not a loop over positions


def _key(o: OpRecord) -> tuple:
    return (o.phase, o.name, o.flops, o.bytes, o.out_bytes, o.dims)


def _elementwise(o: OpRecord) -> bool:
    """A memory-bound op with no FLOPs of its own that writes at least as many elements as it reads
    from its largest input (a cast, an element-wise or broadcast op, a fill): not a reduction."""
    return o.kind == "mem" and o.flops == 0 and o.out_numel >= o.in_numel


def _out_ids(o: OpRecord) -> list[int]:
    return [oid for oid, _, _ in o.outs]


def _in_ids(o: OpRecord) -> list[int]:
    return [rid for rid, _, _ in o.ins]


def _loop_around(keys: list[tuple], first: int, last: int) -> range:
    """The whole loop around ops ``first..last`` (some of its positions; ``keys``: ``_key`` of each of
    the region's ops): the block's period p (the loop step's op count: the shortest shift under
    which nine in ten of its ops repeat), extended both ways while an op repeats the one a step away."""
    n = last - first + 1
    step = next((p for p in range(1, n // 2 + 1)
                 if sum(keys[i] == keys[i + p] for i in range(first, last + 1 - p)) >= 0.9 * (n - p)), None)
    if step is None:
        return range(first, last + 1)
    while first - 1 >= 0 and first - 1 + step < len(keys) and keys[first - 1] == keys[first - 1 + step]:
        first -= 1
    while last + 1 < len(keys) and last + 1 - step >= 0 and keys[last + 1] == keys[last + 1 - step]:
        last += 1
    return range(first, last + 1)


def loop_positions(ops: list[OpRecord], unmatched: list[bool], positions: int | None = None) -> list[bool]:
    """Which of ``ops`` (one region's) stand for positions of a loop: unmatched in the half-sequence
    trace (``unmatched``) and of a kind -- phase, name and size -- that recurs there at least half
    as often as the most frequent such kind. An op that alignment left unmatched by a reordering (a
    weight gradient's copy) is not one: the loop repeats each of its ops once per position.
    ``positions``: the positions the half-sequence trace lacks (None: not known). A loop that steps
    through fewer than one in two of them is a loop over chunks -- HF MiniMax's lightning attention,
    16 blocks of 256 positions, each a few matrix products -- the algorithm a GPU runs as written,
    keeping what each step saves; no fused scan takes its place."""
    keep = [False] * len(ops)
    for phase in ("fwd", "bwd"):
        counts = Counter(_key(o) for o, u in zip(ops, unmatched) if u and o.phase == phase)
        most = max(counts.values(), default=0)
        if positions is not None and 2 * most < positions:
            continue  # a loop over chunks, not positions
        if most >= MIN_POSITIONS:
            for i, o in enumerate(ops):
                keep[i] = keep[i] or (unmatched[i] and o.phase == phase and 2 * counts[_key(o)] >= most)
    return keep


def find_scan(ops: list[OpRecord], per_position: list[bool], trace_ops: list[OpRecord]) -> frozenset[int]:
    """Indices into ``ops`` (one region's ops of a trace) of the scan's ops (module docstring), given
    which ops stand for positions of a loop (``loop_positions``); ``trace_ops``: the whole trace (who
    reads a tensor). Empty: no loop over positions."""
    chosen: set[int] = set()
    keys = [_key(o) for o in ops]  # once: a region's loop may be found in a thousand runs
    for phase in ("fwd", "bwd"):
        at = [i for i, o in enumerate(ops) if per_position[i] and o.phase == phase]
        if not at:
            continue
        gap = 2 * len({_key(ops[i]) for i in at}) + 2
        runs = [[at[0]]]  # blocks of the positions the half-sequence trace lacked (one per loop)
        for i in at[1:]:
            if i - runs[-1][-1] > gap:
                runs.append([])
            runs[-1].append(i)
        for run in runs:
            chosen.update(_loop_around(keys, run[0], run[-1]))
    loop_fwd = sorted(i for i in chosen if ops[i].phase == "fwd")
    if not loop_fwd:
        return frozenset(chosen)
    results = {x for i in loop_fwd for x in _out_ids(ops[i])}
    for i in range(loop_fwd[-1] + 1, len(ops)):  # epilogue: element-wise work on the loop's results
        o = ops[i]
        if o.phase == "fwd" and _elementwise(o) and any(r in results for r in _in_ids(o)):
            chosen.add(i)
            results.update(_out_ids(o))
    readers: dict[int, set[int]] = defaultdict(set)  # tensor -> the forward ops reading it
    for o in trace_ops:
        if o.phase == "fwd":
            for rid in _in_ids(o):
                readers[rid].add(id(o))
    members = {id(ops[i]) for i in chosen}
    for i in range(len(ops) - 1, -1, -1):  # prologue: what only the scan reads (later ops decided first)
        o = ops[i]
        users = set().union(*(readers[x] for x in _out_ids(o)))
        if i not in chosen and o.phase == "fwd" and _elementwise(o) and users and users <= members:
            chosen.add(i)
            members.add(id(o))
    made_fwd = {x for i in chosen if ops[i].phase == "fwd" for x in _out_ids(ops[i])}
    inputs = {r for i in chosen if ops[i].phase == "fwd" for r in _in_ids(ops[i])} - made_fwd
    internal = made_fwd - _read_outside(made_fwd, chosen_ids={id(ops[i]) for i in chosen}, trace_ops=trace_ops)
    made_bwd: set[int] = set()
    for i, o in enumerate(ops):  # backward, in execution order
        if o.phase != "bwd":
            continue
        if i not in chosen:
            ins = _in_ids(o)
            reads_internal = any(r in internal for r in ins)
            only_scan = (o.kind == "mem" and not o.flops and any(r in made_bwd for r in ins)
                         and all(r in internal or r in made_bwd or r in inputs for r in ins))
            if not (reads_internal or only_scan):
                continue
            chosen.add(i)
        made_bwd.update(_out_ids(o))
    return frozenset(chosen)


def _read_outside(made: set[int], chosen_ids: set[int], trace_ops: Iterable[OpRecord]) -> set[int]:
    """The tensors of ``made`` that a forward op outside the scan reads: the scan's results."""
    return {r for o in trace_ops if o.phase == "fwd" and id(o) not in chosen_ids for r in _in_ids(o) if r in made}


@dataclass(frozen=True, kw_only=True)
class ScanTraffic:
    """What the fused kernel of one trace's scan moves (module docstring), tensor by tensor, each
    with the slots -- (position in the scan's op list, input or output index) -- where the scan
    touches it: a tensor of another trace of the region is the same one where their slots meet.
    ``internal_saved``: which of the region's saved tensors only the scan made (indices into its
    saved records)."""

    reads: tuple[tuple[frozenset[tuple[int, int]], float], ...]
    writes: tuple[tuple[frozenset[tuple[int, int]], float], ...]
    saves: tuple[tuple[frozenset[tuple[int, int]], float], ...]  # the reads that nothing else saves
    flops: float
    internal_saved: frozenset[int]


# Ops that take a tensor for its shape and dtype only: they read none of its data.
_SHAPE_ONLY = {"new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "ones_like", "full_like", "empty_like"}


def measure(scan: list[OpRecord | None], trace: Trace, region: str) -> ScanTraffic:
    """The fused kernel's traffic for the scan ops ``scan`` of ``trace`` (module docstring; None:
    an op of the base trace's scan that this trace lacks)."""
    fwd = [(k, o) for k, o in enumerate(scan) if o is not None and o.phase == "fwd"]
    made: dict[int, list] = {}  # tensor -> [slots, bytes written, its whole size]
    for k, o in fwd:
        for j, (oid, nbytes, whole) in enumerate(o.outs):
            w = made.setdefault(oid, [set(), 0.0, whole])
            w[0].add((k, -1 - j))
            w[1] += nbytes
    reads: dict[int, list] = {}  # tensor -> [slots, bytes read, its whole size]
    for k, o in fwd:
        for j, (rid, nbytes, whole) in enumerate(o.ins):
            if rid not in made and o.name not in _SHAPE_ONLY:
                r = reads.setdefault(rid, [set(), 0.0, whole])
                r[0].add((k, j))
                r[1] += nbytes
    results = _read_outside(set(made), {id(o) for o in scan if o is not None}, trace.ops)
    rows = [r for r in trace.saved if r.region == region]
    internal = frozenset(i for i, r in enumerate(rows) if r.root in made and r.root not in results)
    kept = {r.root for r in trace.saved} - {rows[i].root for i in internal}
    activations = {oid for o in trace.ops for oid in _out_ids(o)}  # not parameters or the model's inputs
    inputs = {rid: (frozenset(slots), min(read, whole)) for rid, (slots, read, whole) in reads.items()}
    outputs = tuple((frozenset(made[r][0]), min(made[r][1], made[r][2])) for r in results)
    return ScanTraffic(reads=tuple(inputs.values()), writes=outputs,
                       saves=tuple(v for rid, v in inputs.items() if rid in activations and rid not in kept),
                       flops=sum(o.flops or o.out_numel for _, o in fwd if o.kind == "mem"),
                       internal_saved=internal)


def with_scan(fit: RegionFit, region: str, ops: list[OpRecord], base: Trace,
              others: list[tuple[Trace | None, list[OpRecord | None] | None]],
              positions: int | None = None) -> RegionFit:
    """``fit`` with its loop over positions, if any: only that loop's ops marked ``per_position``
    (``loop_positions``), and marked and measured as one fused scan: the scan's traffic in each
    trace (its ops there: the counterparts of the base trace's), each tensor fitted like a saved
    one (a tensor the varied trace does not hold takes that trace's change of the total)."""
    per_position = loop_positions(ops, [o.per_position for o in fit.ops], positions)
    fit = replace(fit, ops=tuple(o if o.per_position == p else replace(o, per_position=p)
                                 for o, p in zip(fit.ops, per_position)))
    scan = sorted(find_scan(ops, per_position, base.ops))
    if not any(ops[i].phase == "fwd" for i in scan):
        return fit
    at = [measure([ops[i] for i in scan], base, region)]
    at += [None if trace is None or aligned is None else measure([aligned[i] for i in scan], trace, region)
           for trace, aligned in others]

    def fitted(attr: str) -> tuple[FitQuantity, ...]:
        here = getattr(at[0], attr)
        total = sum(v for _, v in here)
        out = []
        for slots, v in here:
            vals = []
            for t in at[1:]:
                there = None if t is None else getattr(t, attr)
                same = None if there is None else next((w for s, w in there if s & slots), None)
                vals.append(None if there is None else same if same is not None else
                            v * sum(w for _, w in there) / total if total else 0.0)
            out.append(FitQuantity(what=f"scan_{attr}", phase="fwd", nbytes=v, exps=_exps(v, *vals)))
        return tuple(out)

    flops = [None if t is None else t.flops for t in at]
    fused = FusedScan(reads=fitted("reads"), writes=fitted("writes"), saves=fitted("saves"),
                      flops=at[0].flops, flops_exps=_exps(at[0].flops, *flops[1:]))
    chosen = set(scan)
    return replace(fit, ops=tuple(replace(o, in_scan=True) if i in chosen else o for i, o in enumerate(fit.ops)),
                   saved=tuple(replace(q, in_scan=True) if i in at[0].internal_saved else q
                               for i, q in enumerate(fit.saved)), scan=fused)


def fit_with_scan(region: str, base: Trace, b2: Trace | None, s_half: Trace | None, t2: Trace | None,
                  seq_len: int | None = None) -> RegionFit:
    """``scaling.fit_region`` of one region, with its loop over positions, if any (``with_scan``);
    ``seq_len``: the base trace's sequence (the half-sequence trace's is ``seq_len // 2``)."""
    aligned = align_region(region, base, b2, s_half, t2)
    fit = fit_region(region, base, b2, s_half, t2, aligned)
    ops, variants = aligned
    positions = seq_len - seq_len // 2 if seq_len else None
    return with_scan(fit, region, ops, base, [(tr, variants[k]) for k, tr in (("b", b2), ("s", s_half), ("t", t2))],
                     positions)
