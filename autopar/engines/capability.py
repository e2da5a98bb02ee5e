"""What each training engine can run, stated once: the search offers it (``plan --engine``), the
exporters refuse everything else (``plan_reason``), and the importers produce nothing else.

Each row was read from the engine's own argument definitions and docs (``Engine.source``). A plan
feature an engine cannot express is never exported as a nearby configuration: ``plan_reason`` names
the feature and the command that plans for that engine.

What "zero" means per engine (autopar's ZeRO stage is what is sharded over the data-parallel ranks:
1 optimizer states, 2 + gradients, 3 + parameters):
  megatron    0 DDP, 1 ``--use-distributed-optimizer``, 2/3 Megatron-FSDP ``optim_grads`` /
              ``optim_grads_params`` (pp = 1 only here: its docs pair it with tp, cp and ep);
  torchtitan  0 ``data_parallel_replicate_degree``, 2/3 FSDP2 ``data_parallel_shard_degree`` with
              ``fsdp_reshard_after_forward`` never / always (FSDP2 cannot keep gradients whole);
  deepspeed   ``zero_optimization.stage`` 0-3;
  accelerate  0 DDP (MULTI_GPU), 2/3 FSDP2 with ``fsdp_reshard_after_forward`` false / true.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from autopar.errors import AutoparError
from autopar.plan import Plan

ENGINE_NAMES = ("autopar", "megatron", "torchtitan", "deepspeed", "accelerate")
EXPORT_ENGINES = ENGINE_NAMES[1:]


@dataclass(frozen=True, kw_only=True)
class Engine:
    """One engine's parallel features, in autopar's terms (plan YAML values)."""

    name: str
    title: str
    software: str  # the cluster profile suffix that prices this engine's software ("" = the base profile)
    zero_stages: tuple[int, ...]
    recompute_modes: tuple[str, ...]  # uniform parallel.recompute values
    recompute_blocks: bool  # per-pipeline-rank counts of none/full blocks (Megatron's block method)
    schedules: tuple[str, ...]  # pipeline schedules; () = no pipeline parallelism
    cp_kinds: tuple[str, ...]  # context-parallel kinds; () = none
    tp: bool
    sequence_parallel: tuple[bool, ...]  # with tp > 1
    ep: bool
    offloads: tuple[str, ...]  # plan offload labels (Offload.label)
    dtypes: tuple[str, ...]
    source: str  # where these rows were read
    optimizers: tuple[str, ...] = ("adam", "adamw", "sgd")


ENGINES: dict[str, Engine] = {
    "autopar": Engine(
        name="autopar", title="autopar run", software="",
        zero_stages=(0, 1, 2, 3), recompute_modes=("none", "selective", "full", "op"), recompute_blocks=True,
        schedules=("gpipe", "1f1b", "interleaved-1f1b"), cp_kinds=("ring", "allgather", "ulysses"), tp=True,
        sequence_parallel=(False, True), ep=True,
        offloads=("none", "optimizer", "params", "activations", "optimizer+activations", "params+activations"),
        dtypes=("bf16", "fp16", "fp32"), source="autopar's executor (docs/run.md)"),
    "megatron": Engine(
        name="megatron", title="Megatron-LM", software="-megatron",
        zero_stages=(0, 1, 2, 3), recompute_modes=("none", "selective", "full"), recompute_blocks=True,
        schedules=("1f1b", "interleaved-1f1b"), cp_kinds=("ring", "allgather", "ulysses"), tp=True,
        sequence_parallel=(False, True), ep=True, offloads=("none", "optimizer"), dtypes=("bf16", "fp16", "fp32"),
        source="Megatron-LM megatron/training/arguments.py (autopar/engines/megatron_lm_arguments.json)"),
    "torchtitan": Engine(
        name="torchtitan", title="torchtitan", software="",
        zero_stages=(0, 2, 3), recompute_modes=("none", "full", "op"), recompute_blocks=False,
        schedules=("gpipe", "1f1b", "interleaved-1f1b"), cp_kinds=("allgather",), tp=True,
        sequence_parallel=(False, True), ep=True, offloads=("none", "params"), dtypes=("bf16", "fp32"),
        source="torchtitan 0.3 config/configs.py (ParallelismConfig, TrainingConfig), "
               "distributed/activation_checkpoint.py"),
    "deepspeed": Engine(
        name="deepspeed", title="DeepSpeed", software="",
        zero_stages=(0, 1, 2, 3), recompute_modes=("none", "full"), recompute_blocks=False,
        schedules=(), cp_kinds=(), tp=True, sequence_parallel=(False,), ep=False,
        offloads=("none", "optimizer", "params"), dtypes=("bf16", "fp16", "fp32"),
        source="DeepSpeed 0.19 runtime/config.py, runtime/zero/config.py, runtime/tensor_parallel/config.py"),
    "accelerate": Engine(
        name="accelerate", title="Hugging Face accelerate", software="",
        zero_stages=(0, 2, 3), recompute_modes=("none", "full"), recompute_blocks=False,
        schedules=(), cp_kinds=("allgather",), tp=True, sequence_parallel=(False,), ep=False,
        offloads=("none", "params"), dtypes=("bf16", "fp16", "fp32"),
        source="accelerate 1.16 commands/launch.py (FSDP and parallelism_config arguments), parallelism_config.py"),
}


def get_engine(name: str) -> Engine:
    """The engine called ``name``; an unknown name is one line listing the known ones."""
    if name not in ENGINES:
        raise AutoparError(f"unknown engine {name!r}; use one of {', '.join(ENGINE_NAMES)}")
    return ENGINES[name]


def _replan(engine: Engine) -> str:
    return f"plan for it with 'autopar plan MODEL.py --gpus N --engine {engine.name}'"


def plan_reason(engine: Engine, plan: Plan) -> str | None:
    """Why ``engine`` cannot run ``plan`` as it is (one line naming the feature and the command that
    plans for the engine), or None when every feature of the plan has an exact equivalent there."""
    par, tr = plan.parallel, plan.training
    what = None
    if par.zero not in engine.zero_stages:
        what = f"ZeRO stage {par.zero} (it runs {', '.join(map(str, engine.zero_stages))})"
    elif par.recompute_blocks is not None and not _mix_ok(engine, plan):
        what = "this per-stage recompute mix" + (
            " (Megatron's block method recomputes the same number of whole blocks in every model chunk)"
            if engine.recompute_blocks else "")
    elif par.recompute_blocks is None and par.recompute not in engine.recompute_modes:
        what = f"recompute {par.recompute} (it runs {', '.join(engine.recompute_modes)})"
    elif par.pp > 1 and not engine.schedules:
        what = "pipeline parallelism (pp > 1)"
    elif par.pp > 1 and par.pp_schedule not in engine.schedules:
        what = f"the {par.pp_schedule} schedule (it runs {', '.join(engine.schedules)})"
    elif par.cp > 1 and par.cp_kind not in engine.cp_kinds:
        what = (f"{par.cp_kind} context parallelism" + (f" (it runs {', '.join(engine.cp_kinds)})"
                                                         if engine.cp_kinds else ""))
    elif par.tp > 1 and not engine.tp:
        what = "tensor parallelism (tp > 1)"
    elif par.tp > 1 and par.sequence_parallel not in engine.sequence_parallel:
        what = f"tensor parallelism {'with' if par.sequence_parallel else 'without'} sequence parallelism"
    elif par.ep > 1 and not engine.ep:
        what = "expert parallelism (ep > 1)"
    elif par.offload.label not in engine.offloads:
        what = f"offload {par.offload.label} (it runs {', '.join(engine.offloads)})"
    elif tr.dtype not in engine.dtypes:
        what = f"dtype {tr.dtype}"
    elif tr.optimizer not in engine.optimizers:
        what = f"the {tr.optimizer} optimizer (it runs {', '.join(engine.optimizers)})"
    elif engine.name == "megatron" and par.zero >= 2 and par.pp > 1:
        what = "ZeRO stage 2-3 (Megatron-FSDP) with pipeline parallelism"
    elif engine.name == "megatron" and par.offload.optimizer and par.zero != 1:
        what = "optimizer offload without the distributed optimizer (zero 1)"
    elif engine.name in ("torchtitan", "accelerate") and par.offload.params and par.zero != 3:
        what = "parameter offload below ZeRO-3"
    elif engine.name == "accelerate" and (par.tp > 1 or par.cp > 1) and par.zero < 2:
        what = "tensor or context parallelism without FSDP2 (its parallelism_config needs ZeRO 2-3)"
    if what is None:
        return None
    return f"{engine.title} cannot run {what}; {_replan(engine)}"


def _mix_ok(engine: Engine, plan: Plan) -> bool:
    """A per-stage recompute mix is expressible as Megatron's ``--recompute-method block``: only none
    and full, the same number of full blocks in every model chunk, and those first in each chunk."""
    if not engine.recompute_blocks:
        return False
    if engine.name == "autopar":
        return True
    return block_recompute_layers(plan) is not None


def block_recompute_layers(plan: Plan) -> int | None:
    """The N of Megatron's ``--recompute-granularity full --recompute-method block
    --recompute-num-layers N`` that recomputes exactly the plan's full blocks (the first N blocks of
    every model chunk), or None when the plan's mix is not of that form."""
    par = plan.parallel
    if par.recompute_blocks is None:
        return None
    modes = plan.block_recompute()
    counts = set()
    for start, end in plan.stage_ranges():
        chunk = modes[start:end]
        n = sum(m == "full" for m in chunk)
        if any(m == "selective" for m in chunk) or any(m != "full" for m in chunk[:n]):
            return None
        counts.add(n)
    return counts.pop() if len(counts) == 1 else None


def search_knobs(engine: Engine, constraints: Mapping[str, Sequence[Any]], dtype: str | None,
                 optimizer: str | None = None) -> dict[str, Any]:
    """The search-space knobs (``search.space.SearchSpace`` fields) that keep ``plan --engine`` to what
    ``engine`` runs. A user constraint outside it is one line saying what the engine runs instead."""
    if engine.name == "autopar":
        return {}
    if dtype is not None and dtype not in engine.dtypes:
        raise AutoparError(f"{engine.title} does not train in {dtype}; use --dtype {' or '.join(engine.dtypes)}")
    if optimizer is not None and optimizer not in engine.optimizers:
        raise AutoparError(f"{engine.title} has no {optimizer} optimizer; use --optimizer "
                           f"{' or '.join(engine.optimizers)}")
    allowed: dict[str, tuple] = {
        "zero": engine.zero_stages, "recompute": engine.recompute_modes, "schedule": engine.schedules,
        "cp_kind": engine.cp_kinds, "sp": engine.sequence_parallel, "offload": engine.offloads}
    for key, values in constraints.items():
        ok = allowed.get(key)
        bad = [v for v in values if ok is not None and v not in ok]
        bad += [v for v in values if key in ("tp", "pp", "cp", "ep") and v > 1 and not _has_dim(engine, key)]
        if bad:
            runs = ", ".join(map(str, ok)) if ok else f"{key} 1 only"
            raise AutoparError(f"{engine.title} cannot run --{key.replace('_', '-')} {bad[0]} (it runs {runs}); "
                               f"drop it or plan for another engine")
    knobs: dict[str, Any] = {
        "zero_stages": engine.zero_stages, "recompute_modes": engine.recompute_modes,
        "sequence_parallel": engine.sequence_parallel, "offload_modes": engine.offloads,
        # no per-stage mixes: the split program mixes all three modes with counts per rank, where
        # Megatron's block method is full blocks first in every chunk, the same count in each
        "refine_recompute_mix": False}
    if engine.schedules:
        knobs["schedules"] = engine.schedules
    else:
        knobs["pp_degrees"] = (1,)
    if engine.cp_kinds:
        knobs["cp_kinds"] = engine.cp_kinds
    else:
        knobs["cp_degrees"] = (1,)
    if not engine.tp:
        knobs["tp_degrees"] = (1,)
    if not engine.ep:
        knobs["ep_degrees"] = (1,)
    return knobs


def _has_dim(engine: Engine, key: str) -> bool:
    return {"tp": engine.tp, "pp": bool(engine.schedules), "cp": bool(engine.cp_kinds), "ep": engine.ep}[key]


def engine_cluster(engine: Engine, cluster: str | None, default: str) -> tuple[str | None, str | None]:
    """The cluster profile that prices ``engine`` on ``cluster`` (a name; None: ``default``): the
    profile with the engine's software suffix where one exists (``h100-80g`` -> ``h100-80g-megatron``),
    and a note when none does (the base profile prices it then). A path or an already-suffixed name
    is kept as given."""
    from autopar.cluster import list_profiles

    name = cluster or default
    if not engine.software or name.endswith(engine.software) or name.endswith((".yaml", ".yml")):
        return cluster, None
    profiles = list_profiles()
    if f"{name}{engine.software}" in profiles:
        return f"{name}{engine.software}", None
    with_it = sorted(p for p in profiles if p.endswith(engine.software))
    return cluster, (f"no {name}{engine.software} profile: {engine.title} is priced with {name}'s software figures "
                     f"(profiles with them: {', '.join(with_it) or 'none'})")
