"""The outer search space: every legal parallel configuration (all but the stage split).

A configuration is legal when dp * tp * pp * cp = N, tp stays inside a node and divides the heads
(and kv heads), cp divides the sequence (ring: into 2 cp chunks for causal load balance; Ulysses: tp*cp
divides the heads), pp * v <= blocks, the global batch divides into dp * micro-batch, and the
schedule's micro-batch rules hold (interleaved: M a multiple of pp; 1F1B/interleaved: M >= pp).
The degree rules are autopar/layout.py's (the same ones the plan file, the estimate and the
executor's preflight apply). Expert parallelism: ep divides the experts and dp * cp (at
any tp and pp). Host offload (``offload_modes``: labels of autopar.plan.Offload) is
searched per ZeRO stage where ``autopar.plan.offload_reason`` allows it (params offload at ZeRO-3,
activation offload without recompute, not with ep > 1 or a layer chain). Each illegal combination is
counted under the reason it was rejected.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

from autopar.cost.stage import Config
from autopar.graph.model_graph import ModelGraph
from autopar.layout import cp_seq_reason, ep_reason, executed_zero, moe_pool, ring_balance_reason, tp_node_reason
from autopar.plan import CP_KINDS, OFFLOAD_LABELS, PLAN_RECOMPUTE_MODES, RECOMPUTE_MODES, Offload, offload_reason

# Per-stage recompute: "mixed" is a per-rank mix of the modes, the split program choosing the counts
# (search.ilp_recompute); searched on request (``plan --recompute mixed``), not by default.
SEARCH_RECOMPUTE_MODES = (*PLAN_RECOMPUTE_MODES, "mixed")


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What the user allows the search to vary."""

    num_gpus: int
    gpus_per_node: int
    global_batch: int
    seq_len: int
    micro_batches: tuple[int, ...]
    dtype_bytes: int = 2
    optimizer: str = "adam"
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute_modes: tuple[str, ...] = PLAN_RECOMPUTE_MODES
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")
    cp_kinds: tuple[str, ...] = CP_KINDS
    max_virtual_stages: int = 16
    # User constraints (``plan --tp 8 --pp 4 ...``): the degrees allowed, None = any legal one.
    # ``schedules`` and ``virtual_stages`` narrow pipelined configurations only (pp = 1 has neither).
    dp_degrees: tuple[int, ...] | None = None
    tp_degrees: tuple[int, ...] | None = None
    pp_degrees: tuple[int, ...] | None = None
    cp_degrees: tuple[int, ...] | None = None
    sequence_parallel: tuple[bool, ...] = (False, True)
    virtual_stages: tuple[int, ...] | None = None
    # Expert parallelism: the ep degrees allowed (None = any legal one) and the busiest
    # ep rank's expert load over the mean that prices them (autopar.cost.expert)
    ep_degrees: tuple[int, ...] | None = None
    moe_imbalance: float = 1.0
    # Per-stage recompute: solve each of the top K single-mode plans again as a per-rank recompute mix
    # (search.search._refine_with_mixes); only where recompute_modes allows every mode it mixes
    refine_recompute_mix: bool = True
    # Host offload: the offload modes allowed (labels of autopar.plan.Offload; "none" = no offload)
    offload_modes: tuple[str, ...] = OFFLOAD_LABELS

    def __post_init__(self) -> None:
        for key in ("num_gpus", "gpus_per_node", "global_batch", "seq_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1")
        if not self.micro_batches or min(self.micro_batches) < 1:
            raise ValueError("micro_batches must be positive")
        if not 1.0 <= self.moe_imbalance <= 64.0:
            raise ValueError(f"moe_imbalance must be in [1, 64] (1 = balanced routing), got {self.moe_imbalance}")
        for key in ("dp_degrees", "tp_degrees", "pp_degrees", "cp_degrees", "virtual_stages", "ep_degrees"):
            values = getattr(self, key)
            if values is not None and (not values or min(values) < 1):
                raise ValueError(f"{key} must be positive integers")
        for key, allowed in (("zero_stages", (0, 1, 2, 3)), ("recompute_modes", SEARCH_RECOMPUTE_MODES),
                             ("schedules", ("gpipe", "1f1b", "interleaved-1f1b")), ("cp_kinds", CP_KINDS),
                             ("sequence_parallel", (False, True)), ("offload_modes", OFFLOAD_LABELS)):
            values = getattr(self, key)
            if not values or any(v not in allowed for v in values):
                raise ValueError(f"{key} must be a non-empty selection of {', '.join(map(str, allowed))}")

    def allows(self, key: str, value: int) -> bool:
        """Whether the degree constraint ``key`` (e.g. ``tp_degrees``) admits ``value``."""
        values = getattr(self, key)
        return values is None or value in values


@functools.lru_cache(maxsize=None)
def _legal_offloads(labels: tuple[str, ...], zero: int, recompute: str, ep: int, chain: bool) -> tuple[Offload, ...]:
    out = []
    for label in labels:
        off = Offload.from_label(label)
        if off.any and (chain or offload_reason(off, zero=zero, recompute=recompute, ep=ep)):
            continue
        out.append(off)
    return tuple(sorted(out, key=lambda o: o.any))


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, found up to its square root (a trillion GPUs is
    a million steps, not a trillion)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


@dataclass(frozen=True, kw_only=True)
class Branch:
    """All legal configs sharing a block cost (tp, cp, kind, sp, micro-batch, recompute) and a
    pipeline degree; they differ in schedule, virtual stages and ZeRO stage."""

    tp: int
    cp: int
    cp_kind: str
    sequence_parallel: bool
    micro_batch: int
    recompute: str
    pp: int
    dp: int
    schedules: tuple[tuple[str, int], ...]
    zero_stages: tuple[int, ...]
    space: SearchSpace
    ep: int = 1  # expert parallelism
    chain: bool = False  # a layer-chain model, planned without host offload

    def offloads(self, zero: int) -> tuple[Offload, ...]:
        """Host offload: the offload modes legal at ``zero`` in this branch, no offload first."""
        return _legal_offloads(self.space.offload_modes, zero, self.recompute, self.ep, self.chain)

    @property
    def block_key(self) -> tuple:
        return (self.tp, self.cp, self.cp_kind, self.sequence_parallel, self.micro_batch, self.recompute, self.ep)

    @property
    def num_configs(self) -> int:
        return len(self.schedules) * sum(len(self.offloads(z)) for z in self.zero_stages)

    @property
    def num_microbatches(self) -> int:
        return self.space.global_batch // (self.dp * self.micro_batch)

    def config(self, schedule: str = "1f1b", virtual_stages: int = 1, zero: int = 0, **changes: object) -> Config:
        fields = dict(
            dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, cp_kind=self.cp_kind,
            sequence_parallel=self.sequence_parallel, zero=zero, recompute=self.recompute, schedule=schedule,
            virtual_stages=virtual_stages, micro_batch=self.micro_batch, global_batch=self.space.global_batch,
            seq_len=self.space.seq_len, dtype_bytes=self.space.dtype_bytes, optimizer=self.space.optimizer,
            ep=self.ep, moe_imbalance=self.space.moe_imbalance,
        )
        fields.update(changes)
        return Config(**fields)

    def configs(self) -> Iterator[Config]:
        for schedule, v in self.schedules:
            for zero in self.zero_stages:
                for off in self.offloads(zero):
                    yield self.config(schedule, v, zero, offload=off)


# spec/support.NO_EXPERTS (the spec imports torch, the search does not): ep's reason for a dense model
_NO_EXPERTS = "no mixture of experts in the blocks"


def enumerate_branches(graph: ModelGraph, space: SearchSpace, rejected: Counter) -> Iterator[Branch]:
    """Every legal branch; illegal combinations are counted in ``rejected`` by reason."""
    n, L = space.num_gpus, graph.num_blocks
    recompute_modes = tuple(rc for rc in space.recompute_modes if rc == "none" or not _recompute_reason(graph, rc))
    for rc in set(space.recompute_modes) - set(recompute_modes):
        rejected[f"recompute {rc}: {_recompute_reason(graph, rc)}"] += 1
    # Dimensions the model spec refuses are said once, with the reason (the plan's "rejected" line).
    if True in space.sequence_parallel and graph.supports("tp") is None and graph.supports("sp"):
        rejected[f"sp: {graph.supports('sp')}"] += 1
    if 3 in space.zero_stages and graph.supports("zero3"):
        rejected[f"zero3: {graph.supports('zero3')}"] += 1
    ep_reason = graph.supports("ep")  # said where the model has experts somewhere, or ep was asked for
    if ep_reason and (not ep_reason.startswith(_NO_EXPERTS) or any(e > 1 for e in space.ep_degrees or ())):
        rejected[f"ep: {ep_reason}"] += 1
    for tp in divisors(n):
        if not space.allows("tp_degrees", tp):
            rejected["constraint: tp"] += 1
            continue
        if tp_node_reason(tp, space.gpus_per_node):
            rejected["tp > GPUs per node"] += 1
            continue
        reason = graph.tp_allowed(tp)
        if reason:
            rejected["tp does not divide heads" if "heads" in reason else f"tp not applicable: {reason}"] += 1
            continue
        for cp in divisors(n // tp):
            if not space.allows("cp_degrees", cp):
                rejected["constraint: cp"] += 1
                continue
            kinds = _cp_kinds(graph, space, tp, cp, rejected)
            if not kinds:
                continue
            for pp in divisors(n // (tp * cp)):
                if pp > L:
                    rejected["pp > blocks"] += 1
                    continue
                if pp > 1 and graph.supports("pp"):
                    rejected[f"pp: {graph.supports('pp')}"] += 1
                    continue
                if pp > 1 and cp > 1 and graph.supports("cp_pp"):
                    rejected[f"cp with pp: {graph.supports('cp_pp')}"] += 1
                    continue
                dp = n // (tp * cp * pp)
                if not (space.allows("pp_degrees", pp) and space.allows("dp_degrees", dp)):
                    rejected["constraint: pp or dp"] += 1
                    continue
                zeros = space.zero_stages if dp * cp > 1 else (0,)
                if 3 in zeros and graph.supports("zero3"):
                    zeros = tuple(z for z in zeros if z != 3)
                # A stage that runs as another allowed one (ZeRO-2 at pp > 1 runs as ZeRO-1) is that one.
                zeros = tuple(z for z in zeros if executed_zero(z, pp) == z or executed_zero(z, pp) not in zeros)
                for mb in space.micro_batches:
                    if space.global_batch % (dp * mb):
                        rejected["global batch not divisible by dp x micro-batch"] += 1
                        continue
                    m = space.global_batch // (dp * mb)
                    schedules = tuple(_schedules(space, pp, L, m, rejected))
                    if not schedules:
                        continue
                    for kind in kinds:
                        for sp in (space.sequence_parallel if tp > 1 and not graph.supports("sp") else (False,)):
                            # expert parallelism: ep from dp x cp, or dp x cp x tp under SP (autopar.layout)
                            eps = _ep_degrees(graph, space, moe_pool(dp, cp, tp, sp), sp, rejected)
                            for rc in recompute_modes:
                                for ep in eps:
                                    yield Branch(tp=tp, cp=cp, cp_kind=kind, sequence_parallel=sp, micro_batch=mb,
                                                 recompute=rc, pp=pp, dp=dp, schedules=schedules, zero_stages=zeros,
                                                 space=space, ep=ep, chain=bool(graph.chain))


def enumerate_configs(graph: ModelGraph, space: SearchSpace, rejected: Counter) -> Iterator[Config]:
    """Yield every legal Config (the brute-force oracle walks exactly this space)."""
    for branch in enumerate_branches(graph, space, rejected):
        yield from branch.configs()


def _recompute_reason(graph: ModelGraph, mode: str) -> str | None:
    """Why the executor cannot run recompute ``mode`` on this model (None: it can)."""
    if mode != "mixed":
        return graph.supports(mode)
    if graph.chain:
        return "a layer chain is split per unit, not in repeated blocks (plan one recompute mode)"
    if not mix_modes(graph)[1:]:
        return "neither selective nor full recompute runs on this model"
    return None


def mix_modes(graph: ModelGraph) -> tuple[str, ...]:
    """Per-stage recompute: the modes a "mixed" config mixes: none, and each recompute the model supports;
    selective only where it saves memory (blocks with s^2 activations; without them it keeps
    what none keeps, in more time: search.search drops it alike)."""
    selective_saves = any(q.exps.quadratic for q in graph.regions["block"].saved)
    return tuple(m for m in RECOMPUTE_MODES
                 if m == "none" or (not graph.supports(m) and (m != "selective" or selective_saves)))


def _ep_degrees(graph: ModelGraph, space: SearchSpace, pool: int, folds_tp: bool, rejected: Counter) -> tuple[int, ...]:
    """The legal ep degrees (autopar.layout's ``ep_reason``: ep divides the experts and its
    ``pool``, dp x cp, or dp x cp x tp under sequence parallelism: ``folds_tp``). 1 is always
    legal (dense experts)."""
    if graph.moe is None or graph.supports("ep"):  # what the model must have: spec/support.py
        return (1,) if space.allows("ep_degrees", 1) else ()
    out = []
    for ep in divisors(graph.moe.num_experts):  # the experts' rule holds: only the pool's can fail
        if not space.allows("ep_degrees", ep):
            rejected["constraint: ep"] += 1
        elif ep_reason(ep, pool, graph.moe.num_experts, folds_tp=folds_tp):
            rejected["ep does not divide dp x cp (x tp under sp)"] += 1
        else:
            out.append(ep)
    return tuple(out)


def _cp_kinds(graph: ModelGraph, space: SearchSpace, tp: int, cp: int, rejected: Counter) -> tuple[str, ...]:
    if cp == 1:
        return ("ring",)
    if graph.cp_reason:  # the model's own reason (spec/support.py), not a guess at it
        rejected[f"cp: {graph.cp_reason}"] += 1
        return ()
    kinds = []
    for kind in space.cp_kinds:
        if kind == "ring" and ring_balance_reason(cp, space.seq_len):
            rejected["cp ring: seq not divisible by 2 x cp"] += 1
        elif kind != "ring" and cp_seq_reason(cp, space.seq_len):
            rejected["cp: seq not divisible by cp"] += 1
        elif kind == "ulysses" and graph.ulysses_allowed(tp, cp):
            rejected["cp ulysses: tp x cp does not divide heads"] += 1
        else:
            kinds.append(kind)
    return tuple(kinds)


def _schedules(space: SearchSpace, pp: int, num_blocks: int, m: int, rejected: Counter) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1  # no pipeline: the schedule has no meaning
        return
    for schedule in space.schedules:
        if schedule != "interleaved-1f1b" and not space.allows("virtual_stages", 1):
            continue
        if schedule == "gpipe":
            yield "gpipe", 1
        elif schedule == "1f1b":
            if m < pp:
                rejected["1f1b: fewer micro-batches than stages"] += 1
            else:
                yield "1f1b", 1
        else:
            if m % pp:
                rejected["interleaved: micro-batches not a multiple of pp"] += 1
                continue
            for v in range(2, space.max_virtual_stages + 1):
                if pp * v > num_blocks:
                    break
                if not space.allows("virtual_stages", v):
                    continue
                yield "interleaved-1f1b", v
