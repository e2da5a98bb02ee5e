"""An engine's configuration read back in autopar's terms (``EngineConfig``), and the plan it is.

Every importer (``read_megatron``, ``read_torchtitan``, ...) turns a user's file into one
``EngineConfig``: the degrees, batch, schedule, recompute and offload the engine would run, plus
what the file does not say (``None``: the command line gives it, e.g. ``--gpus`` for Megatron flags,
which name no world size) and what autopar does not understand (``ignored``, listed to the user in one
line, never dropped silently). ``to_plan`` checks it against the model and the world size and builds
the plan ``autopar estimate`` prices; every contradiction is one line naming both sides.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from autopar.errors import AutoparError
from autopar.plan import ClusterRef, ModelRef, Offload, Parallel, Plan, Training


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What an engine's file configures, in plan YAML terms. ``dp`` None: the world size decides it."""

    engine: str
    source: str  # the file it was read from
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_kind: str = "ring"
    sequence_parallel: bool = False
    zero: int = 0
    recompute: str = "none"
    recompute_full_per_chunk: int | None = None  # Megatron's block method: full blocks first in each chunk
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    chunk_layers: tuple[int, ...] | None = None  # blocks per (virtual) stage in chunk order; None = even
    # torchtitan's split when its file names no modules: (stages or None, first-less, last-less,
    # layers per stage or None), resolved against the model's blocks (torchtitan.weighted_split)
    weighted_split: tuple[int | None, int, int, int | None] | None = None
    ep: int = 1
    offload: str = "none"
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    local_batch_size: int | None = None  # rows per dp rank and accumulation step (global = local x dp)
    seq_len: int | None = None
    dtype: str = "bf16"
    optimizer: str = "adam"
    num_gpus: int | None = None
    gpus_per_node: int | None = None
    num_layers: int | None = None  # what the file says the model has, checked against the model file
    num_heads: int | None = None
    num_kv_heads: int | None = None
    cluster: str | None = None  # a cluster profile the file names (autopar's export header)
    ignored: tuple[str, ...] = ()  # settings autopar does not read
    # Software settings the file states, as the Cluster fields that price them (e.g. Megatron's
    # --tp-comm-overlap -> tp_comm_overlap): settings of the run, applied by ``priced_cluster``.
    software: tuple[tuple[str, Any], ...] = ()

    def with_overrides(self, **values: object) -> "EngineConfig":
        """This config with the command line's values where given (not None)."""
        return dataclasses.replace(self, **{k: v for k, v in values.items() if v is not None})


def to_plan(cfg: EngineConfig, *, model_file: str, num_blocks: int, sha256: str | None, cluster_ref: str,
            gpus_per_node: int, default_seq_len: int | None, num_heads: int | None = None,
            num_kv_heads: int | None = None) -> Plan:
    """The plan ``cfg`` runs on the model (``num_blocks`` blocks, ``num_heads`` / ``num_kv_heads``
    attention heads where it has them) and cluster given. Raises a one-line AutoparError for what is
    missing (world size, batch) or contradicts the model or the world."""
    where = f"{cfg.source}"
    for what, said, has in (("layers", cfg.num_layers, num_blocks), ("attention heads", cfg.num_heads, num_heads),
                            ("key/value heads", cfg.num_kv_heads, num_kv_heads)):
        if said is not None and has is not None and said != has:
            raise AutoparError(f"{where} configures {said} {what} but {model_file} has {has}; give the model file "
                               f"the configuration describes")
    model_parallel = cfg.tp * cfg.pp * cfg.cp
    gpus = cfg.num_gpus
    if gpus is None and cfg.dp is not None:
        gpus = cfg.dp * model_parallel
    if gpus is None:
        raise AutoparError(f"{where} does not say how many GPUs it runs on; give --gpus N")
    if gpus % model_parallel:
        raise AutoparError(f"{where}: tp x pp x cp = {cfg.tp}x{cfg.pp}x{cfg.cp} = {model_parallel} does not divide "
                           f"{gpus} GPUs; change --gpus or the degrees")
    dp = gpus // model_parallel
    if cfg.dp is not None and cfg.dp != dp:
        raise AutoparError(f"{where}: dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp} x cp {cfg.cp} = "
                           f"{cfg.dp * model_parallel}, not the {gpus} GPUs given; change --gpus or the degrees")
    mbs = cfg.micro_batch_size or 1
    gbs = cfg.global_batch_size
    if gbs is None and cfg.local_batch_size is not None:
        gbs = cfg.local_batch_size * dp
    if gbs is None:
        raise AutoparError(f"{where} does not give the global batch; give --global-batch B")
    if gbs % (mbs * dp):
        raise AutoparError(f"{where}: the global batch {gbs} is not divisible by micro-batch {mbs} x dp {dp}; "
                           f"change the batch sizes or the degrees")
    seq = cfg.seq_len or default_seq_len
    if seq is None:
        raise AutoparError(f"{where} does not give the sequence length; give --seq-len S")
    stages, chunk_layers, v = None, cfg.chunk_layers, cfg.pp_virtual_stages
    if cfg.weighted_split is not None:
        chunk_layers = weighted_split(num_blocks, cfg.pp, cfg.weighted_split, where)
        v = len(chunk_layers) // cfg.pp
        check_virtual_stages(cfg.pp_schedule, v, where)
    if chunk_layers is not None:
        if sum(chunk_layers) != num_blocks:
            raise AutoparError(f"{where}: its pipeline stages hold {sum(chunk_layers)} layers but {model_file} "
                               f"has {num_blocks} blocks")
        bounds, start = [], 0
        for n in chunk_layers:
            bounds.append((start, start + n))
            start += n
        stages = tuple(bounds)
    parallel = Parallel(dp=dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, cp_kind=cfg.cp_kind if cfg.cp > 1 else "ring",
                        sequence_parallel=cfg.sequence_parallel and cfg.tp > 1, zero=cfg.zero,
                        recompute=cfg.recompute, pp_schedule=cfg.pp_schedule if cfg.pp > 1 else "1f1b",
                        pp_virtual_stages=v, stages=stages, ep=cfg.ep,
                        offload=Offload.from_label(cfg.offload))
    plan = Plan(model=ModelRef(file=model_file, num_blocks=num_blocks, sha256=sha256),
                cluster=ClusterRef(profile=cluster_ref, num_gpus=gpus, gpus_per_node=min(gpus_per_node, gpus)),
                training=Training(global_batch_size=gbs, micro_batch_size=mbs, seq_len=seq, dtype=cfg.dtype,
                                  optimizer=cfg.optimizer),
                parallel=parallel)
    if cfg.recompute_full_per_chunk is not None:
        plan = _with_block_recompute(plan, cfg.recompute_full_per_chunk, where)
    return plan


def check_virtual_stages(schedule: str, v: int, where: str) -> None:
    """A file's schedule against its stages per pipeline rank: interleaved needs 2 or more, the others 1."""
    if (schedule == "interleaved-1f1b") != (v > 1):
        raise AutoparError(f"{where}: {schedule} with {v} stages per pipeline rank; interleaved schedules need "
                           f"2 or more, the others 1")


def _with_block_recompute(plan: Plan, full_per_chunk: int, where: str) -> Plan:
    """Megatron's ``--recompute-method block --recompute-num-layers N``: the first N blocks of every
    model chunk recomputed in full, the rest not, as per-rank counts (``parallel.recompute_blocks``)."""
    par = plan.parallel
    ranges = plan.stage_ranges()
    if any(end - start < full_per_chunk for start, end in ranges):
        raise AutoparError(f"{where}: --recompute-num-layers {full_per_chunk} exceeds the layers of a pipeline "
                           f"stage; lower it")
    if full_per_chunk == 0:
        return dataclasses.replace(plan, parallel=dataclasses.replace(par, recompute="none"))
    if all(end - start == full_per_chunk for start, end in ranges):
        return dataclasses.replace(plan, parallel=dataclasses.replace(par, recompute="full"))
    if par.pp_virtual_stages > 1:
        raise AutoparError(f"{where}: block recompute of some layers with virtual pipeline stages is not "
                           f"modelled; use --recompute-method uniform or recompute all layers")
    counts = tuple((end - start - full_per_chunk, 0, full_per_chunk) for start, end in ranges)
    return dataclasses.replace(plan, parallel=dataclasses.replace(par, recompute="none", recompute_blocks=counts))


def header_line(plan: Plan) -> str:
    """The comment line an export carries so that reading it back prices the same request:
    ``autopar: gpus N gpus-per-node G cluster NAME``."""
    return (f"autopar: gpus {plan.cluster.num_gpus} gpus-per-node {plan.cluster.gpus_per_node} "
            f"cluster {plan.cluster.profile}")


def read_header(text: str) -> dict[str, Any]:
    """What an export's ``autopar:`` comment line records (gpus, gpus-per-node as ints, cluster)."""
    m = re.search(r"^\s*(?:#|//)\s*autopar:(.*)$", text, re.MULTILINE)
    words = m.group(1).split() if m else []
    out: dict[str, Any] = dict(zip(words[::2], words[1::2]))
    for key in ("gpus", "gpus-per-node"):
        if key in out:
            out[key] = int(out[key]) if str(out[key]).isdigit() else None
    return out


def split_launch(tokens: list[str], script_markers: tuple[str, ...] = ()) -> tuple[list[str], int | None]:
    """A launch line's training flags (the tokens after its script: the last ``*.py`` or one of
    ``script_markers``, e.g. ``torchtitan.train`` after ``-m``) and the GPU count its torchrun prefix
    gives (``--nproc-per-node`` x ``--nnodes``), or the tokens as they are and None."""
    scripts = [i for i, t in enumerate(tokens) if t.endswith(".py") or t in script_markers]
    if not scripts:
        return tokens, None
    launch, flags = tokens[:scripts[-1]], tokens[scripts[-1] + 1:]
    options, i = {}, 0
    while i < len(launch):
        t = launch[i]
        if t.startswith("--"):
            key, _, value = t[2:].partition("=")
            if not value and i + 1 < len(launch) and not launch[i + 1].startswith("-"):
                value, i = launch[i + 1], i + 1
            options[key.replace("_", "-")] = value
        i += 1
    per_node, nodes = options.get("nproc-per-node", ""), options.get("nnodes", "1").split(":")[-1]
    return flags, int(per_node) * int(nodes) if per_node.isdigit() and nodes.isdigit() else None


def weighted_split(num_layers: int, pp: int, rule: tuple, source: str) -> tuple[int, ...]:
    """torchtitan's split when no module names are given (its ``pipeline_parallel_layers_per_stage``
    and first/last-stage-less-layers rule): stages share num_layers + first + last evenly, extra to
    the first stages, and the first and last give up ``first`` and ``last`` layers for the embedding
    and the output head."""
    stages, first, last, per_stage = rule
    if stages is None:
        stages = math.ceil((num_layers + first + last) / per_stage)
    if stages % pp:
        raise AutoparError(f"{source}: {stages} pipeline stages do not divide over pp {pp} (torchtitan refuses it)")
    effective = num_layers + first + last
    base, extra = divmod(effective, stages)
    if base == 0 or first > base or last > base:
        raise AutoparError(f"{source}: {num_layers} layers cannot fill {stages} pipeline stages (torchtitan refuses it)")
    sizes = [base + (i < extra) for i in range(stages)]
    sizes[0] -= first
    sizes[-1] -= last
    return tuple(sizes)


# Cluster fields of Megatron-Core's memory model (cost/megatron_memory.py): they apply on a profile that
# prices Megatron's buffers (main_grad_bytes > 0), never on one that prices autopar run's.
MEGATRON_MEMORY_FIELDS = ("main_grad_bytes", "optimizer_moment_bytes", "master_weight_bytes")


def priced_cluster(cluster: Any, cfg: EngineConfig) -> Any:
    """``cluster`` (an autopar.cluster.Cluster) with the software settings ``cfg`` states."""
    values = dict(cfg.software)
    if not getattr(cluster, "main_grad_bytes", 0):
        values = {k: v for k, v in values.items() if k not in MEGATRON_MEMORY_FIELDS}
    return dataclasses.replace(cluster, **values) if values else cluster
