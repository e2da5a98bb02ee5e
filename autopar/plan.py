"""The plan file, version 1 (docs/design.md §3, a contract): frozen dataclasses and strict YAML load/save.

Loading uses ``yaml.safe_load`` only, so no tag can construct Python objects. Every unknown key,
missing required key, wrong type and impossible value is a ``PlanError`` that names the key.
``prediction`` is written by ``plan``/``estimate`` and ignored on load.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from autopar.errors import PlanError
from autopar.layout import Layout, cp_seq_reason, tp_node_reason, world_size_reason

PLAN_VERSION = 1
CP_KINDS = ("ring", "allgather", "ulysses")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
# The modes a per-stage mix counts (``recompute_blocks``), by how much each keeps: none keeps every
# saved tensor, selective drops the attention core's, full keeps only each block's input.
RECOMPUTE_MODES = ("none", "selective", "full")
# Every mode ``parallel.recompute`` takes: the mix modes, and ``op`` (per-op selective recompute,
# torchtitan's ``selective_ac_option: op``: a block keeps its input, every other matrix product's
# output and the attention kernel's output, and re-runs the rest; executor/parallel/recompute.py). A
# uniform mode: it is not counted in ``recompute_blocks``.
PLAN_RECOMPUTE_MODES = (*RECOMPUTE_MODES, "op")
DTYPES = ("bf16", "fp16", "fp32")
# the words a refusal names each support key with (Plan.dimensions_used)
DIMENSION_NAMES = {"tp": "tensor parallelism", "sp": "sequence parallelism", "pp": "pipeline parallelism",
                   "cp": "context parallelism", "zero3": "ZeRO-3", "selective": "selective recompute",
                   "full": "full recompute", "op": "per-op selective recompute",
                   "cp_pp": "context parallelism with pipeline stages"}
OPTIMIZERS = ("adam", "adamw", "sgd")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _check_int(key: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise PlanError(f"{key} must be >= {minimum}, got {value}")


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PlanError(f"{key} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    """Which model file the plan was made for."""

    file: str
    num_blocks: int
    sha256: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not self.file:
            raise PlanError(f"model.file must be a non-empty path string, got {self.file!r}")
        _check_int("model.num_blocks", self.num_blocks, minimum=1)
        if self.sha256 is not None and (
            not isinstance(self.sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", self.sha256)
        ):
            raise PlanError("model.sha256 must be 64 lowercase hex digits (or be left out)")


@dataclass(frozen=True, kw_only=True)
class ClusterRef:
    """Which cluster profile and how many GPUs."""

    profile: str
    num_gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if not isinstance(self.profile, str) or not self.profile:
            raise PlanError(f"cluster.profile must be a profile name or path, got {self.profile!r}")
        _check_int("cluster.num_gpus", self.num_gpus)
        _check_int("cluster.gpus_per_node", self.gpus_per_node)

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)


@dataclass(frozen=True, kw_only=True)
class Training:
    """Batch, sequence and numeric settings of one optimizer step."""

    global_batch_size: int
    micro_batch_size: int
    seq_len: int
    dtype: str = "bf16"
    optimizer: str = "adam"

    def __post_init__(self) -> None:
        _check_int("training.global_batch_size", self.global_batch_size)
        _check_int("training.micro_batch_size", self.micro_batch_size)
        _check_int("training.seq_len", self.seq_len)
        _check_choice("training.dtype", self.dtype, DTYPES)
        _check_choice("training.optimizer", self.optimizer, OPTIMIZERS)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


OFFLOAD_KINDS = ("optimizer", "params", "grads", "activations")


@dataclass(frozen=True, kw_only=True)
class Offload:
    """``parallel.offload`` (host offload): what lives in host memory instead of on the GPU.

    Two executed forms (autopar/executor/parallel/offload.py) and activations beside either:
    optimizer only -- fp32 master and optimizer states on the host, the update on the CPU
    (ZeRO-Offload style); params + grads + optimizer -- FSDP2's ``CPUOffloadPolicy`` at ZeRO-3
    (sharded parameters and gradients on the host, so the optimizer steps there too). Other
    combinations are refused by ``offload_reason`` with what to change."""

    optimizer: bool = False
    params: bool = False
    grads: bool = False
    activations: bool = False

    def __post_init__(self) -> None:
        for key in OFFLOAD_KINDS:
            if not isinstance(getattr(self, key), bool):
                raise PlanError(f"parallel.offload.{key} must be true or false, got {getattr(self, key)!r}")

    @property
    def any(self) -> bool:
        return self.optimizer or self.params or self.grads or self.activations

    @property
    def states(self) -> bool:
        """Model states (at least the optimizer's) on the host."""
        return self.optimizer or self.params or self.grads

    @property
    def label(self) -> str:
        """``none``, ``optimizer``, ``params`` (params + grads + optimizer), ``activations`` or
        ``X+activations``: the names ``plan --offload`` takes."""
        base = "params" if self.params else "optimizer" if self.optimizer else ""
        if self.activations:
            return f"{base}+activations" if base else "activations"
        return base or "none"

    @classmethod
    def from_label(cls, label: str) -> "Offload":
        if label not in OFFLOAD_LABELS:
            raise PlanError(f"unknown offload {label!r}; use one of {', '.join(OFFLOAD_LABELS)}")
        parts = set(label.split("+")) - {"none"}
        states = "params" in parts
        return cls(optimizer=states or "optimizer" in parts, params=states, grads=states,
                   activations="activations" in parts)


OFFLOAD_LABELS = ("none", "optimizer", "params", "activations", "optimizer+activations", "params+activations")
NO_OFFLOAD = Offload()


def offload_reason(off: Offload, *, zero: int, recompute: str, ep: int = 1) -> str | None:
    """Why ``off`` cannot run with these settings (one line saying what to change), or None."""
    if not off.any:
        return None
    if off.params != off.grads:
        return ("parallel.offload: FSDP2's CPUOffloadPolicy moves parameters and gradients together; "
                "set params and grads both true or both false")
    if off.params and not off.optimizer:
        return "parallel.offload: with parameters on the host the optimizer steps there too; set optimizer: true"
    if off.params and zero != 3:
        return (f"parallel.offload.params needs zero 3 (FSDP2 CPUOffloadPolicy shards what it offloads), "
                f"got zero {zero}; set zero: 3 or offload the optimizer only")
    if off.activations and recompute != "none":
        return ("parallel.offload.activations runs with recompute none: torch's checkpoint keeps a recomputed "
                "region's inputs on the device, out of reach of the offload hooks; set recompute: none")
    if ep > 1:
        return "parallel.offload is not priced with expert parallelism (ep > 1); plan with ep = 1 or without offload"
    return None


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """Parallel degrees and strategies. Ranks are laid out [pp, dp, cp, tp], tp innermost (``layout``)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_kind: str = "ring"
    sequence_parallel: bool = False
    zero: int = 0
    recompute: str = "none"
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    stages: tuple[tuple[int, int], ...] | None = None
    # Expert parallelism: experts sharded over ep ranks drawn from the dp x cp ranks
    # (ep innermost); optional, 1 = every rank holds every expert. Written only when > 1.
    ep: int = 1
    # Per-stage recompute: per pipeline rank, blocks under each of RECOMPUTE_MODES, as
    # (none, selective, full) counts; overrides ``recompute`` for that rank. None = ``recompute``
    # everywhere (written only when present). Which blocks get which mode: ``Plan.block_recompute``.
    recompute_blocks: tuple[tuple[int, int, int], ...] | None = None
    # Host offload: what lives in host memory (Offload); written only when something is offloaded.
    offload: Offload = NO_OFFLOAD

    def __post_init__(self) -> None:
        if isinstance(self.offload, Mapping):
            bad = sorted(set(self.offload) - set(OFFLOAD_KINDS), key=str)
            if bad:
                raise PlanError(f"unknown key 'parallel.offload.{bad[0]}'; allowed here: {', '.join(OFFLOAD_KINDS)}")
            object.__setattr__(self, "offload", Offload(**self.offload))
        elif not isinstance(self.offload, Offload):
            raise PlanError("parallel.offload must be a mapping {optimizer, params, grads, activations: true|false}")
        for key in ("dp", "tp", "pp", "cp", "pp_virtual_stages", "ep"):
            _check_int(f"parallel.{key}", getattr(self, key))
        _check_choice("parallel.cp_kind", self.cp_kind, CP_KINDS)
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"parallel.sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        _check_int("parallel.zero", self.zero, minimum=0)
        if self.zero > 3:
            raise PlanError(f"parallel.zero must be 0, 1, 2 or 3; got {self.zero}")
        _check_choice("parallel.recompute", self.recompute, PLAN_RECOMPUTE_MODES)
        _check_choice("parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if self.pp_schedule == "interleaved-1f1b":
            if self.pp < 2 or self.pp_virtual_stages < 2:
                raise PlanError(
                    "parallel.pp_schedule interleaved-1f1b needs pp >= 2 and pp_virtual_stages >= 2; "
                    "use 1f1b or gpipe otherwise"
                )
        elif self.pp_virtual_stages != 1:
            raise PlanError(
                f"parallel.pp_virtual_stages must be 1 for {self.pp_schedule}; "
                "only interleaved-1f1b has virtual stages"
            )
        # expert parallelism: ep ranks are drawn from dp x cp (x tp under SP): autopar.layout's rule
        reason = self.layout.expert_reason(None)
        if reason:
            raise PlanError(f"parallel.{reason}")
        if self.recompute_blocks is not None:  # per-stage recompute
            object.__setattr__(self, "recompute_blocks", _normalise_recompute_blocks(self.recompute_blocks, self.pp))
        recompute = self.recompute if self.recompute_blocks is None else "mixed"
        reason = offload_reason(self.offload, zero=self.zero, recompute=recompute, ep=self.ep)
        if reason:
            raise PlanError(reason)
        if self.stages is not None:
            object.__setattr__(self, "stages", _normalise_stages(self.stages))
            if len(self.stages) != self.num_stage_chunks:
                raise PlanError(
                    f"parallel.stages has {len(self.stages)} ranges but pp x pp_virtual_stages = "
                    f"{self.num_stage_chunks}; give one [start, end] range per (virtual) stage"
                )

    @property
    def layout(self) -> Layout:
        """The rank layout of these degrees (autopar/layout.py)."""
        return Layout.of(self)

    @property
    def num_stage_chunks(self) -> int:
        """Number of model chunks: pp ranks times virtual stages per rank."""
        return self.pp * self.pp_virtual_stages

    @property
    def world_size(self) -> int:
        return self.layout.world_size


def _normalise_stages(stages: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(stages, (list, tuple)) or not stages:
        raise PlanError("parallel.stages must be a list of [start, end] block ranges")
    out: list[tuple[int, int]] = []
    for i, rng in enumerate(stages):
        if not isinstance(rng, (list, tuple)) or len(rng) != 2:
            raise PlanError(f"parallel.stages[{i}] must be a [start, end] pair, got {rng!r}")
        start, end = rng
        _check_int(f"parallel.stages[{i}][0]", start, minimum=0)
        _check_int(f"parallel.stages[{i}][1]", end, minimum=0)
        if end <= start:
            raise PlanError(f"parallel.stages[{i}] = [{start}, {end}] is empty; every stage needs >= 1 block")
        if i == 0 and start != 0:
            raise PlanError("parallel.stages must start at block 0")
        if i > 0 and start != out[-1][1]:
            raise PlanError(
                f"parallel.stages[{i}] starts at {start} but the previous range ends at {out[-1][1]}; "
                "ranges must be contiguous"
            )
        out.append((start, end))
    return tuple(out)


def _normalise_recompute_blocks(value: Any, pp: int) -> tuple[tuple[int, int, int], ...]:
    """Per-stage recompute: ``[{none: n, selective: n, full: n}, ...]`` (one mapping per pipeline rank; an
    omitted mode counts 0) as (none, selective, full) tuples. Already-normalised tuples pass."""
    key = "parallel.recompute_blocks"
    if not isinstance(value, (list, tuple)) or len(value) != pp:
        got = f"{len(value)} entries" if isinstance(value, (list, tuple)) else repr(value)
        raise PlanError(f"{key} must be a list of one {{none: n, selective: n, full: n}} mapping per pipeline "
                        f"rank (pp = {pp}), got {got}")
    out = []
    for r, entry in enumerate(value):
        if isinstance(entry, (list, tuple)) and len(entry) == len(RECOMPUTE_MODES):
            entry = dict(zip(RECOMPUTE_MODES, entry))
        if not isinstance(entry, Mapping):
            raise PlanError(f"{key}[{r}] must be a mapping like {{none: 2, selective: 0, full: 1}}, got {entry!r}")
        unknown = [k for k in entry if k not in RECOMPUTE_MODES]
        if unknown:
            raise PlanError(f"{key}[{r}] has unknown recompute mode {unknown[0]!r}; "
                            f"the modes are {', '.join(RECOMPUTE_MODES)}")
        for mode in RECOMPUTE_MODES:
            _check_int(f"{key}[{r}].{mode}", entry.get(mode, 0), minimum=0)
        out.append(tuple(entry.get(mode, 0) for mode in RECOMPUTE_MODES))
    return tuple(out)


def even_stage_ranges(num_blocks: int, num_chunks: int) -> tuple[tuple[int, int], ...]:
    """Split ``num_blocks`` into ``num_chunks`` contiguous ranges whose sizes differ by at most one.

    The extra blocks of an uneven division go to the middle chunks, because the first chunk also
    carries the embedding and the last the output head and loss.
    """
    if num_chunks > num_blocks:
        raise PlanError(
            f"cannot split {num_blocks} blocks into {num_chunks} pipeline stages; lower pp or pp_virtual_stages"
        )
    base, extra = divmod(num_blocks, num_chunks)
    sizes = [base] * num_chunks
    order = sorted(range(num_chunks), key=lambda k: (k in (0, num_chunks - 1), abs(k - (num_chunks - 1) / 2)))
    for k in order[:extra]:
        sizes[k] += 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return tuple(ranges)


# What a plan was chosen for (``objective``, optional; absent = throughput). ``time-to-target``:
# the GPU count and global batch that reach a target loss soonest, from the gradient noise scale
# (autopar/search/time_to_target.py, docs/batch-size.md).
OBJECTIVES = ("throughput", "time-to-target")
_TIME_TO_TARGET_KEYS = ("noise_scale", "target_steps", "at_batch")


def _check_positive_number(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{key} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise PlanError(f"{key} must be a positive finite number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Objective:
    """``objective``: what the search optimised when it chose this plan, and its inputs.

    ``throughput`` (the default, and what a plan without the key means): the fastest step at the
    plan's global batch. ``time-to-target``: the least time to reach a target loss over a sweep of
    GPU counts and global batches, with the steps at each batch from the empirical model
    S(B) = S_min (1 + B_noise / B) anchored at ``target_steps`` steps at ``at_batch`` samples
    (``autopar.search.time_to_target``). ``noise_scale`` is B_noise in samples (the unit of
    ``training.global_batch_size``); ``noise_scale_from`` the run report it was read from, if any.
    The objective says why this layout was chosen; it changes nothing that runs."""

    kind: str = "throughput"
    noise_scale: float | None = None
    target_steps: float | None = None
    at_batch: int | None = None
    noise_scale_from: str | None = None

    def __post_init__(self) -> None:
        _check_choice("objective.kind", self.kind, OBJECTIVES)
        if self.kind == "throughput":
            for key in (*_TIME_TO_TARGET_KEYS, "noise_scale_from"):
                if getattr(self, key) is not None:
                    raise PlanError(f"objective.{key} is for kind time-to-target, not {self.kind}")
            return
        for key in _TIME_TO_TARGET_KEYS:
            if getattr(self, key) is None:
                raise PlanError(f"missing required key 'objective.{key}' (kind time-to-target)")
        _check_positive_number("objective.noise_scale", self.noise_scale)
        _check_positive_number("objective.target_steps", self.target_steps)
        _check_int("objective.at_batch", self.at_batch)
        if self.noise_scale_from is not None and (not isinstance(self.noise_scale_from, str)
                                                  or not self.noise_scale_from):
            raise PlanError(f"objective.noise_scale_from must be a path string, got {self.noise_scale_from!r}")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete, self-consistent parallel plan (plan YAML v1)."""

    model: ModelRef
    cluster: ClusterRef
    training: Training
    parallel: Parallel
    prediction: Mapping[str, Any] | None = field(default=None, compare=False)
    version: int = PLAN_VERSION
    # What the plan was chosen for (Objective); None = throughput, and nothing is written. Like
    # ``prediction`` it is not part of the layout, so two plans that run alike compare equal.
    objective: Objective | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            raise PlanError(f"version must be {PLAN_VERSION}, got {self.version!r}")
        par, n = self.parallel, self.cluster.num_gpus
        reason = world_size_reason(par.layout, n) or tp_node_reason(par.tp, self.cluster.gpus_per_node)
        if reason:
            raise PlanError(reason)
        gbs, mbs = self.training.global_batch_size, self.training.micro_batch_size
        if gbs % (mbs * par.dp):
            raise PlanError(
                f"training.global_batch_size = {gbs} is not divisible by micro_batch_size x dp = "
                f"{mbs}x{par.dp}; pick a global batch that is a multiple of {mbs * par.dp}"
            )
        m = self.num_microbatches
        if par.pp_schedule == "interleaved-1f1b" and m % par.pp:
            raise PlanError(
                f"interleaved-1f1b needs the number of micro-batches ({m}) to be a multiple of pp ({par.pp})"
            )
        if par.pp > 1 and par.pp_schedule != "gpipe" and m < par.pp:
            raise PlanError(
                f"{par.pp_schedule} with pp = {par.pp} needs at least {par.pp} micro-batches per step, "
                f"got {m}; raise the global batch or lower micro_batch_size"
            )
        reason = cp_seq_reason(par.cp, self.training.seq_len)
        if reason:
            raise PlanError(reason)
        if par.num_stage_chunks > self.model.num_blocks:
            raise PlanError(
                f"pp x pp_virtual_stages = {par.num_stage_chunks} exceeds the model's "
                f"{self.model.num_blocks} blocks; lower pp or pp_virtual_stages"
            )
        if par.stages is not None and par.stages[-1][1] != self.model.num_blocks:
            raise PlanError(
                f"parallel.stages must end at block {self.model.num_blocks} (model.num_blocks), "
                f"got {par.stages[-1][1]}"
            )
        if par.recompute_blocks is not None:  # per-stage recompute: each rank's counts cover its blocks
            for r, (counts, n) in enumerate(zip(par.recompute_blocks, self.rank_blocks())):
                if sum(counts) != n:
                    raise PlanError(
                        f"parallel.recompute_blocks[{r}] counts {sum(counts)} blocks "
                        f"({', '.join(f'{m} {k}' for m, k in zip(RECOMPUTE_MODES, counts))}) but pipeline rank {r} "
                        f"holds {n}; make each rank's counts sum to its blocks")

    def rank_blocks(self) -> tuple[int, ...]:
        """Blocks on each pipeline rank (its chunks c = r, r + pp, ...)."""
        sizes = [end - start for start, end in self.stage_ranges()]
        return tuple(sum(sizes[r::self.parallel.pp]) for r in range(self.parallel.pp))

    def dimensions_used(self) -> list[tuple[str, bool, str]]:
        """(support key, whether this plan uses it, what to change instead) for every dimension a
        model may not support (autopar.spec.support): the one list estimate and the executor's
        preflight check a plan against, so both refuse what the search never offers."""
        par = self.parallel
        modes = set(self.block_recompute()) if par.recompute_blocks is not None else {par.recompute}
        return [
            ("tp", par.tp > 1, "plan with tp = 1"),
            ("sp", par.tp > 1 and par.sequence_parallel, "set sequence_parallel: false"),
            ("pp", par.pp > 1, "plan with pp = 1"),
            ("cp", par.cp > 1, "plan with cp = 1"),
            ("zero3", par.zero == 3, "use zero 0, 1 or 2"),
            ("selective", "selective" in modes, "use recompute none or full"),
            ("full", "full" in modes, "use recompute none"),
            ("op", "op" in modes, "use recompute none or full"),
            ("cp_pp", par.cp > 1 and par.pp > 1, "plan with pp = 1 or cp = 1"),
        ]

    def block_recompute(self) -> tuple[str, ...]:
        """The recompute mode of every block, by block index (per-stage recompute). Without
        ``recompute_blocks`` every block has ``parallel.recompute``. With it, each pipeline rank's
        blocks in execution order (its chunks in chunk order, each chunk's blocks ascending -- that
        is, ascending block index) take ``full`` first, then ``selective``, then ``none``: the cost
        model prices a rank by its counts alone, so this rule is the executor's, stated once here."""
        par = self.parallel
        if par.recompute_blocks is None:
            return (par.recompute,) * self.model.num_blocks
        modes = [par.recompute] * self.model.num_blocks
        ranges = self.stage_ranges()
        for r, (n_none, n_sel, n_full) in enumerate(par.recompute_blocks):
            blocks = [b for c in range(r, len(ranges), par.pp) for b in range(*ranges[c])]
            order = ["full"] * n_full + ["selective"] * n_sel + ["none"] * n_none
            for b, mode in zip(blocks, order):
                modes[b] = mode
        return tuple(modes)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline per step (gradient-accumulation steps)."""
        return self.training.global_batch_size // (self.training.micro_batch_size * self.parallel.dp)

    def stage_ranges(self) -> tuple[tuple[int, int], ...]:
        """Block ranges of every (virtual) stage chunk, in chunk order."""
        if self.parallel.stages is not None:
            return self.parallel.stages
        return even_stage_ranges(self.model.num_blocks, self.parallel.num_stage_chunks)

    def with_prediction(self, prediction: Mapping[str, Any]) -> "Plan":
        return dataclasses.replace(self, prediction=dict(prediction))


_SECTIONS: dict[str, tuple[type, set[str], set[str]]] = {
    # section -> (dataclass, required keys, optional keys)
    "model": (ModelRef, {"file", "num_blocks"}, {"sha256"}),
    "cluster": (ClusterRef, {"profile", "num_gpus", "gpus_per_node"}, set()),
    "training": (Training, {"global_batch_size", "micro_batch_size", "seq_len"}, {"dtype", "optimizer"}),
    "parallel": (
        Parallel,
        {"dp", "tp", "pp"},
        {"cp", "cp_kind", "sequence_parallel", "zero", "recompute", "pp_schedule", "pp_virtual_stages", "stages",
         "ep", "recompute_blocks", "offload"},
    ),
}
_TOP_REQUIRED = {"version", "model", "cluster", "training", "parallel"}
_TOP_OPTIONAL = {"prediction", "objective"}
_OBJECTIVE_KEYS = {"kind", *_TIME_TO_TARGET_KEYS, "noise_scale_from"}


def plan_from_dict(data: Any) -> Plan:
    """Build a Plan from parsed YAML, naming the first offending key on error."""
    if not isinstance(data, dict):
        raise PlanError("a plan must be a YAML mapping with keys version, model, cluster, training, parallel")
    _check_keys("plan", data, _TOP_REQUIRED, _TOP_OPTIONAL)
    version = data["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version != PLAN_VERSION:
        raise PlanError(f"version must be {PLAN_VERSION}, got {data['version']!r}")
    parts: dict[str, Any] = {}
    for section, (cls, required, optional) in _SECTIONS.items():
        body = data[section]
        if not isinstance(body, dict):
            raise PlanError(f"{section} must be a mapping, got {type(body).__name__}")
        _check_keys(section, body, required, optional)
        parts[section] = cls(**body)
    prediction = data.get("prediction")
    if prediction is not None and not isinstance(prediction, dict):
        raise PlanError("prediction must be a mapping (it is written by autopar and ignored on load)")
    objective = None
    if "objective" in data:  # optional: what the plan was chosen for
        body = data["objective"]
        if not isinstance(body, dict):
            raise PlanError(f"objective must be a mapping, got {type(body).__name__}")
        _check_keys("objective", body, {"kind"}, _OBJECTIVE_KEYS - {"kind"})
        objective = Objective(**body)
    return Plan(version=PLAN_VERSION, prediction=None, objective=objective, **parts)


def _check_keys(where: str, body: dict, required: set[str], optional: set[str]) -> None:
    for key in body:
        if not isinstance(key, str):
            raise PlanError(f"{where} has a non-string key {key!r}")
    unknown = sorted(set(body) - required - optional)
    if unknown:
        allowed = ", ".join(sorted(required | optional))
        name = unknown[0] if where == "plan" else f"{where}.{unknown[0]}"
        raise PlanError(f"unknown key '{name}'; allowed here: {allowed}")
    missing = sorted(required - set(body))
    if missing:
        name = missing[0] if where == "plan" else f"{where}.{missing[0]}"
        raise PlanError(f"missing required key '{name}'")


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The YAML-ready mapping of a plan, keys in contract order."""
    par = dataclasses.asdict(plan.parallel)
    par["stages"] = [list(r) for r in plan.stage_ranges()] if plan.parallel.stages is not None else None
    if par["stages"] is None:
        del par["stages"]
    if par["ep"] == 1:  # expert parallelism: dense plans are written exactly as before ep existed
        del par["ep"]
    if plan.parallel.recompute_blocks is None:  # per-stage recompute: written only when present
        del par["recompute_blocks"]
    else:
        par["recompute_blocks"] = [dict(zip(RECOMPUTE_MODES, counts)) for counts in plan.parallel.recompute_blocks]
    if plan.parallel.offload.any:  # host offload: written only when something is offloaded
        par["offload"] = dataclasses.asdict(plan.parallel.offload)
    else:
        del par["offload"]
    model = dataclasses.asdict(plan.model)
    if model["sha256"] is None:
        del model["sha256"]
    out: dict[str, Any] = {
        "version": plan.version,
        "model": model,
        "cluster": dataclasses.asdict(plan.cluster),
        "training": dataclasses.asdict(plan.training),
        "parallel": par,
    }
    if plan.objective is not None:  # written only when present: a throughput plan reads as before
        out["objective"] = {k: v for k, v in dataclasses.asdict(plan.objective).items() if v is not None}
    if plan.prediction:
        out["prediction"] = _plain(plan.prediction)
    return out


def _plain(value: Any) -> Any:
    """Convert numpy/tuple values to plain YAML types so safe_load reads them back."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return str(value)


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a plan file. Raises PlanError with a one-line message."""
    from autopar.yamlload import MAX_INPUT_BYTES

    p = Path(path)
    if not p.is_file():
        raise PlanError(f"plan file {p} does not exist")
    try:
        size = p.stat().st_size
        if size > MAX_INPUT_BYTES:
            raise PlanError(f"plan file {p} is {size / 2**20:,.1f} MiB; a plan is at most "
                            f"{MAX_INPUT_BYTES / 2**20:g} MiB (is it the right file?)")
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read plan file {p}: {exc}") from None
    return parse_plan(text, source=str(p))


def parse_plan(text: str, source: str = "<plan>") -> Plan:
    """Parse plan YAML text (a SafeLoader: python tags, duplicate keys and oversized text are refused)."""
    from autopar.errors import AutoparError
    from autopar.yamlload import load_yaml

    try:
        data = load_yaml(text, source)
    except AutoparError as exc:
        raise PlanError(str(exc)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise PlanError(f"{source} is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise PlanError(f"{source} is nested too deeply to be a plan") from None
    try:
        return plan_from_dict(data)
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from None
    except TypeError as exc:  # e.g. unhashable keys from odd YAML
        raise PlanError(f"{source}: malformed plan ({exc})") from None


def model_path(model_file: str, plan_path: str | os.PathLike[str] | None) -> str:
    """Where a plan's ``model.file`` is: a relative path is taken beside the plan (``autopar plan``
    writes it so: ``portable_model_path``), else as given (relative to the working directory, as
    plans written before and ``save_plan`` of an API plan have it)."""
    p = Path(model_file)
    if plan_path is not None and not p.is_absolute():
        beside = Path(plan_path).parent / p
        if beside.exists():
            return str(beside)
    return model_file


MAX_UP_LEVELS = 2  # a model further from the plan than ../../ is written as an absolute path


def portable_model_path(model_file: str, plan_path: str | os.PathLike[str]) -> str:
    """``model_file`` as ``autopar plan`` writes it into the plan at ``plan_path``: a path given
    relative to the working directory becomes relative to the plan's directory (``model_path``
    finds it from any directory, and a plan moved with its model keeps working), or absolute where
    that would climb more than ``MAX_UP_LEVELS`` directories; an absolute path is kept."""
    if Path(model_file).is_absolute():
        return model_file
    target = Path(model_file).resolve()
    try:
        relative = Path(os.path.relpath(target, Path(plan_path).resolve().parent))
    except ValueError:  # another drive
        return str(target)
    if relative.parts[:MAX_UP_LEVELS + 1].count("..") > MAX_UP_LEVELS:
        return str(target)
    return relative.as_posix()


def dump_plan(plan: Plan) -> str:
    return yaml.safe_dump(plan_to_dict(plan), sort_keys=False, default_flow_style=None, width=100)


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write the plan atomically (temp file + rename): a crash never leaves half a plan."""
    return write_text_atomic(path, dump_plan(plan))


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Atomic, umask-respecting write that refuses devices, FIFOs and directories (autopar.outputs)."""
    from autopar.outputs import write_text_atomic as write

    return write(path, text)
