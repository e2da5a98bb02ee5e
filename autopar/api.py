"""The Python API for notebooks and scripts, and the one orchestration layer: the commands
(autopar/commands/) parse their arguments, call these functions and print, so a function here and
its command give the same answer for the same inputs.

    import autopar
    plan = autopar.plan("examples/gpt.py", gpus=64, cluster="a100-80g")   # search -> Plan
    est = autopar.estimate("examples/gpt.py", plan)                        # cost model -> Estimate
    print(autopar.explain(plan))                                           # the explain tables
    exe = autopar.apply_plan("examples/gpt.py", plan)                      # inside torchrun only

``model`` is a model file (a path, or a loaded ``autopar.modelfile.ModelFile``) as docs/design.md §3
defines it: a plan records the file it was made for, and ``autopar run`` rebuilds the model from
it on every rank, so an in-memory ``nn.Module`` cannot be planned or run (it is refused with a
one-line error saying so). ``plan`` arguments may be a ``Plan`` or a path to a plan YAML.

A request is priced the way a command prices it:

* **measured profiles**: ``profile`` (a measured profile from ``autopar profile``) is layered over
  ``cluster`` (or is the cluster, when full), and the cluster is priced under the conditions of the
  run (autopar.profile_conditions: its dtype, the ranks sharing one machine). With a measured
  profile the default dtype is the profile's, and a CPU profile's default global batch is
  ``CPU_SAMPLES_PER_RANK`` samples per rank;
* **the graph cache**: the model's graph comes from ``~/.cache/autopar`` (graph/cache.py;
  ``use_cache=False`` traces the model file again);
* **expert parallelism**: ``moe_imbalance`` prices ep > 1 at that routing imbalance (the busiest
  expert-parallel rank's tokens over the mean; 1.0 is balanced).

What a command prints as ``autopar: warning: ...`` lines goes to ``warn`` (default: a Python
``UserWarning``). Every user error is an ``autopar.errors.AutoparError`` (one line). Heavy imports
(torch, the search, the executor) happen inside the functions, so ``import autopar`` stays cheap.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from autopar.errors import AutoparError
from autopar.plan import Plan, load_plan

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster import Cluster
    from autopar.cost.step import Estimate
    from autopar.engines.config import EngineConfig
    from autopar.executor.parallel.apply import Executable
    from autopar.explain.explanation import Explanation
    from autopar.graph import ModelGraph
    from autopar.graph.cache import ModelSource
    from autopar.modelfile import ModelFile
    from autopar.profile_conditions import RunConditions
    from autopar.rehearse import Rehearsal
    from autopar.search.driver import PlanSearch

ModelLike = Any  # str | os.PathLike | ModelFile
PlanLike = Any  # Plan | str | os.PathLike
Warn = Callable[[str], None]

_SPACE_KNOBS = ("zero_stages", "recompute_modes", "schedules", "cp_kinds", "max_virtual_stages", "dp_degrees",
                "tp_degrees", "pp_degrees", "cp_degrees", "sequence_parallel", "virtual_stages", "ep_degrees",
                "offload_modes", "refine_recompute_mix")

DEFAULT_CLUSTER = "a100-80g"
# A CPU profile's default global batch: 8 samples per rank -- seconds a step for the small models a
# CPU trains, so that `autopar validate` of the plan finishes in about a minute (4M tokens, the GPU
# default, took a CPU validate twelve minutes).
CPU_SAMPLES_PER_RANK = 8


def python_warning(message: str) -> None:
    """The default ``warn``: a ``UserWarning`` (the commands print an ``autopar: warning:`` line)."""
    warnings.warn(message, UserWarning, stacklevel=3)


def load_model(model: ModelLike) -> "ModelFile":
    """A ``ModelFile`` from a path or a ``ModelFile`` (see the module docstring for nn.Module)."""
    from autopar.modelfile import ModelFile, load_model_file

    if isinstance(model, ModelFile):
        return model
    if isinstance(model, (str, os.PathLike)):
        return load_model_file(model)
    raise AutoparError(
        f"model must be a path to a model file (build_model(), example_inputs()), got {type(model).__name__}; "
        "a plan names the file that autopar run rebuilds the model from, so write the model to a .py file"
    )


def as_plan(plan: PlanLike) -> Plan:
    """A ``Plan`` from a ``Plan`` or a plan YAML path."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    raise AutoparError(f"plan must be an autopar Plan or a path to a plan YAML, got {type(plan).__name__}")


def plan_model_path(plan: Plan, plan_path: str | os.PathLike[str] | None = None) -> str:
    """The plan's ``model.file`` (``autopar.plan.model_path``: beside the plan, else as given)."""
    from autopar.plan import model_path

    return model_path(plan.model.file, plan_path)


def _model_for(plan: Plan, model: ModelLike | None, plan_path: Any = None) -> "ModelFile":
    return load_model(model if model is not None else plan_model_path(plan, plan_path))


def _graph_source(model: ModelLike) -> "str | os.PathLike[str] | ModelFile":
    """What the graph cache reads: a path as it is (on a hit the model file is not even imported),
    else a ``ModelFile`` (anything else is refused by ``load_model``)."""
    return model if isinstance(model, (str, os.PathLike)) else load_model(model)


def _model_label(model: ModelLike) -> str:
    """The model file as messages name it."""
    return str(model) if isinstance(model, (str, os.PathLike)) else str(getattr(model, "path", "MODEL.py"))


def plan_graph(plan: Plan, model: ModelLike | None = None, plan_path: Any = None,
               use_cache: bool = True) -> "tuple[ModelLike, ModelGraph, ModelSource]":
    """(the model file, its graph, its source) at the plan's sequence length and dtype, through the
    graph cache; ``model`` None: the plan's model file (beside ``plan_path`` when not found as is)."""
    from autopar.search.driver import load_graph

    source_model = model if model is not None else plan_model_path(plan, plan_path)
    graph, source = load_graph(_graph_source(source_model), seq_len=plan.training.seq_len,
                               dtype=plan.training.dtype, use_cache=use_cache)
    return source_model, graph, source


def cluster_for(plan: Plan, cluster: "str | Cluster | None" = None) -> "Cluster":
    """The cluster profile to cost ``plan`` on: ``cluster`` (name, path or Cluster), else the plan's."""
    from autopar.cluster import Cluster, load_cluster

    if isinstance(cluster, Cluster):
        return cluster
    return load_cluster(cluster or plan.cluster.profile)


@dataclass(frozen=True, kw_only=True)
class ClusterChoice:
    """The cluster a request names, loaded (not yet priced for a run): ``ref`` is what a plan records
    as ``cluster.profile`` (the profile's name, or the path as given), ``label`` how messages name it."""

    cluster: "Cluster"
    ref: str
    label: str


def choose_cluster(cluster: "str | os.PathLike[str] | Cluster | None" = None, profile: str | None = None,
                   default: str = DEFAULT_CLUSTER) -> ClusterChoice:
    """The cluster of ``--cluster`` and ``--profile``: ``profile`` (a measured profile) layered over
    ``cluster`` (a name, a path or a ``Cluster``; None: ``default``), or the cluster itself when it
    is a full profile and no ``cluster`` is given (autopar.cluster.load_cluster_and_profile)."""
    from autopar.cluster import Cluster, load_cluster_and_profile

    if isinstance(cluster, Cluster):
        if profile is not None:
            raise AutoparError("a measured profile is layered over a cluster named by name or path, not over a "
                               "Cluster object: pass cluster='NAME' (or the profile alone)")
        return ClusterChoice(cluster=cluster, ref=cluster.name, label=cluster.name)
    cluster = None if cluster is None else str(cluster)
    profile = None if profile is None else str(profile)
    loaded = load_cluster_and_profile(cluster, profile, default)
    named = cluster or profile or default
    return ClusterChoice(cluster=loaded, ref=named if Path(named).suffix else loaded.name,
                         label=profile or cluster or default)


def with_memory_margin(choice: ClusterChoice, fraction: float) -> ClusterChoice:
    """``choice`` with plans leaving ``fraction`` of each GPU's memory free (``plan --memory-margin``;
    autopar.cluster.Cluster.memory_margin_fraction); a one-line error outside [0, 0.5)."""
    import dataclasses

    from autopar.cluster import memory_margin

    fraction = memory_margin(fraction, "--memory-margin")
    return dataclasses.replace(choice, cluster=dataclasses.replace(choice.cluster, memory_margin_fraction=fraction))


def price(choice: ClusterChoice, run: "RunConditions", *, model_label: str, warn: Warn = python_warning) -> "Cluster":
    """``choice``'s cluster priced for ``run`` (measured profiles: autopar.profile_conditions): a
    one-line ClusterError where the profile's figures cannot hold (another dtype or device), a
    ``warn`` line for each soft difference. A datasheet profile comes back as it is."""
    from autopar.profile_conditions import price_for_run

    priced = price_for_run(choice.cluster, run, profile_label=choice.label, model_label=model_label)
    for line in priced.warnings:
        warn(line)
    return priced.cluster


def _space_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(knobs) - set(_SPACE_KNOBS))
    if unknown:
        raise AutoparError(f"unknown search knob {unknown[0]!r}; allowed: {', '.join(_SPACE_KNOBS)}")
    return {k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in knobs.items()}


def plan_search(model: ModelLike, gpus: int, cluster: "str | Cluster | ClusterChoice | None" = None, *,
           profile: str | None = None, gpus_per_node: int | None = None, global_batch: int | None = None,
           micro_batch: int | Sequence[int] = (1, 2, 4, 8), seq_len: int | None = None, dtype: str | None = None,
           optimizer: str = "adam", top: int = 5, moe_imbalance: float = 1.0,
           constraints: Mapping[str, Sequence[Any]] | None = None,
           progress: Callable[[int, int, float], None] | None = None, use_cache: bool = True,
           warn: Warn = python_warning, engine: str = "autopar", **knobs: Any) -> "PlanSearch":
    """The ranked plans of one ``autopar plan`` request (``search.driver.PlanSearch``: the top
    ``top`` plans, fastest first, with the graph, the priced cluster and the space searched).

    ``cluster``/``profile``: as ``choose_cluster`` (default a100-80g). ``dtype`` None: the measured
    profile's, else bf16. ``global_batch`` None: about 4M tokens (``search.driver.default_global_batch``),
    on a CPU profile ``CPU_SAMPLES_PER_RANK`` x ``gpus``. ``constraints`` (keys of
    ``search.driver.CONSTRAINTS``, ``plan --tp 8 ...``) narrow the space and are recorded in the
    plans as fixed by the user; ``knobs`` (``search.space.SearchSpace`` fields) narrow it silently.
    ``engine`` (``autopar.engines``: megatron, torchtitan, deepspeed, accelerate): only plans that
    engine runs, priced with its software profile where one exists (``plan --engine``).
    Raises ``InfeasibleError`` when nothing fits.
    """
    from autopar.engines.capability import get_engine, search_knobs
    from autopar.profile_conditions import RunConditions, default_dtype, is_cpu_profile, ranks_on_host
    from autopar.search.driver import search_plans

    eng = get_engine(engine)
    knobs = {**search_knobs(eng, constraints or {}, dtype, optimizer), **_space_knobs(knobs)}
    choice = cluster if isinstance(cluster, ClusterChoice) else engine_cluster_choice(engine, cluster, profile, warn)
    dtype = dtype or default_dtype(choice.cluster)
    ranks = ranks_on_host(choice.cluster, gpus, gpus_per_node or choice.cluster.gpus_per_node)
    priced = price(choice, RunConditions(dtype=dtype, ranks_on_host=ranks), model_label=_model_label(model),
                   warn=warn)
    if global_batch is None and is_cpu_profile(choice.cluster):
        global_batch = CPU_SAMPLES_PER_RANK * gpus
    found = search_plans(_graph_source(model), gpus=gpus, cluster=priced, cluster_ref=choice.ref,
                         gpus_per_node=gpus_per_node, global_batch=global_batch,
                         micro_batches=(micro_batch,) if isinstance(micro_batch, int) else tuple(micro_batch),
                         seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                         top_k=searched_top(eng, top), knobs={**knobs, "moe_imbalance": moe_imbalance}, constraints=constraints,
                         progress=progress, use_cache=use_cache)
    return engine_plans(found, eng, top)


# plan --engine: the search keeps this many plans beyond --top, so that dropping the few an engine's
# knobs cannot exclude (engines.capability.plan_reason: e.g. Megatron-FSDP with pp) still leaves --top.
ENGINE_TOP_MARGIN = 5


def searched_top(engine: Any, top: int) -> int:
    """How many plans to search for ``top`` plans ``engine`` runs (``engine_plans`` keeps those)."""
    return top if engine.name == "autopar" else top + ENGINE_TOP_MARGIN


def engine_plans(found: "PlanSearch", engine: Any, top: int) -> "PlanSearch":
    """``found`` with only the plans ``engine`` runs (the first ``top`` of them); an InfeasibleError
    when none is left."""
    import dataclasses

    from autopar.engines.capability import plan_reason
    from autopar.errors import InfeasibleError

    if engine.name == "autopar":
        return found
    keep = [i for i, p in enumerate(found.plans) if plan_reason(engine, p) is None][:top]
    if not keep:
        raise InfeasibleError(f"no plan fits that {engine.title} runs: "
                              f"{plan_reason(engine, found.plans[0])}; plan without --engine to see autopar's")
    result = dataclasses.replace(found.result, top=tuple(found.result.top[i] for i in keep))
    return dataclasses.replace(found, result=result, plans=tuple(found.plans[i] for i in keep))


def engine_cluster_choice(engine: str, cluster: "str | os.PathLike[str] | Cluster | None", profile: str | None,
                          warn: Warn = python_warning) -> ClusterChoice:
    """``choose_cluster`` for a plan an engine runs: a named cluster becomes the profile with the
    engine's software figures where one exists (``h100-80g`` -> ``h100-80g-megatron``)."""
    from autopar.engines.capability import engine_cluster, get_engine

    if isinstance(cluster, (str, type(None))) and profile is None:
        cluster, note = engine_cluster(get_engine(engine), cluster, DEFAULT_CLUSTER)
        if note:
            warn(note)
    return choose_cluster(cluster, profile)


def plan(model: ModelLike, gpus: int, cluster: "str | Cluster | None" = None, *, warn: Warn = python_warning,
         **options: Any) -> Plan:
    """Search the fastest plan of ``model`` on ``gpus`` GPUs that fits memory: what ``autopar plan``
    writes for the same request. ``options`` are ``plan_search``'s: profile, gpus_per_node,
    global_batch, micro_batch, seq_len, dtype, optimizer, top, moe_imbalance, constraints,
    use_cache, and the search-space knobs zero_stages, recompute_modes (add "mixed" for per-stage
    counts), schedules, cp_kinds, max_virtual_stages, dp/tp/pp/cp_degrees, sequence_parallel,
    virtual_stages. Returns the best plan with its ``prediction``; raises ``InfeasibleError`` when
    nothing fits.
    """
    found = plan_search(model, gpus, cluster, warn=warn, **options)
    if found.warning:
        warn(found.warning)
    return found.plans[0]


@dataclass(frozen=True, kw_only=True)
class Estimation:
    """An estimate with what it was made from: the plan, the model's graph, the priced cluster, the
    model file (as given, or the plan's) and the routing imbalance of expert parallelism."""

    estimate: "Estimate"
    plan: Plan
    graph: "ModelGraph"
    cluster: "Cluster"
    model: ModelLike
    moe_imbalance: float


def _warn_if_changed(plan: Plan, source: Any, warn: Warn, tail: str = "") -> None:
    if plan.model.sha256 and plan.model.sha256 != source.sha256:
        warn(f"{source.path} changed since the plan was made (sha256 differs){tail}")


def estimation(model: ModelLike | None, plan: PlanLike, cluster: "str | Cluster | None" = None, *,
               profile: str | None = None, moe_imbalance: float = 1.0, use_cache: bool = True,
               warn: Warn = python_warning) -> Estimation:
    """``autopar estimate``'s prediction of ``plan`` with what it was made from. ``model`` None: the
    plan's model file; ``cluster``/``profile`` as ``choose_cluster`` (default: the plan's profile),
    priced for the plan's dtype and ranks per machine."""
    from autopar.cost.compute import measured_table_warning
    from autopar.cost.estimate import estimate_plan
    from autopar.profile_conditions import RunConditions, ranks_on_host

    p = as_plan(plan)
    choice = choose_cluster(cluster, profile, p.cluster.profile)
    run = RunConditions(dtype=p.training.dtype, ranks_on_host=ranks_on_host(
        choice.cluster, p.cluster.num_gpus, p.cluster.gpus_per_node))
    priced = price(choice, run, model_label=_model_label(model) if model is not None else p.model.file, warn=warn)
    if cluster is None and profile is None and p.cluster.gpus_per_node != priced.gpus_per_node:
        warn(f"plan has {p.cluster.gpus_per_node} GPUs per node, profile {priced.name} has {priced.gpus_per_node}")
    source_model, graph, source = plan_graph(p, model, None if isinstance(plan, Plan) else plan, use_cache)
    _warn_if_changed(p, source, warn, "; the estimate is for the file as it is now")
    note = measured_table_warning(graph, priced)
    if note:
        warn(note)
    return Estimation(estimate=estimate_plan(p, graph, priced, moe_imbalance), plan=p, graph=graph,
                      cluster=priced, model=source_model, moe_imbalance=moe_imbalance)


def estimate(model: ModelLike | None, plan: PlanLike, cluster: "str | Cluster | None" = None,
             **options: Any) -> "Estimate":
    """The cost model's prediction of ``plan``: what ``autopar estimate`` prints for the same inputs
    (``options``: ``estimation``'s profile, moe_imbalance, use_cache, warn). ``model`` None: the
    plan's model file. ``estimate_json(autopar.estimate(...))`` is the ``--json`` contract object."""
    return estimation(model, plan, cluster, **options).estimate


def rank(est: Estimation, *, top: int = 20, use_cache: bool = True, engine: str = "autopar") -> "PlanSearch":
    """The ``top`` plans ``autopar plan`` finds for the request ``est`` answers (its GPUs, GPUs per
    node, global batch, sequence, dtype, optimizer and routing imbalance, on its priced cluster):
    where ``autopar estimate`` ranks a plan. ``engine``: among the plans that engine runs."""
    from autopar.engines.capability import get_engine, search_knobs
    from autopar.search.driver import search_plans

    p, t = est.plan, est.plan.training
    eng = get_engine(engine)
    found = search_plans(est.model, gpus=p.cluster.num_gpus, cluster=est.cluster, cluster_ref=est.cluster.name,
                         gpus_per_node=p.cluster.gpus_per_node, global_batch=t.global_batch_size, seq_len=t.seq_len,
                         dtype=t.dtype, optimizer=t.optimizer,
                         top_k=searched_top(eng, top), use_cache=use_cache,
                         knobs={**search_knobs(eng, {}, None), "moe_imbalance": est.moe_imbalance})
    return engine_plans(found, eng, top)


@dataclass(frozen=True, kw_only=True)
class Imported:
    """An engine's configuration file read back (``autopar estimate --from``): what it configures,
    the plan that is, and that plan's estimate."""

    config: "EngineConfig"
    estimation: Estimation


def estimation_from(engine: str, path: str | os.PathLike[str], model: ModelLike, cluster: str | None = None, *,
                    gpus: int | None = None, gpus_per_node: int | None = None, global_batch: int | None = None,
                    micro_batch: int | None = None, seq_len: int | None = None, moe_imbalance: float = 1.0,
                    use_cache: bool = True, warn: Warn = python_warning) -> Imported:
    """``autopar estimate MODEL --from ENGINE FILE``: the engine's file (Megatron-LM flags, a
    torchtitan TOML, a DeepSpeed JSON, an accelerate config) read into a plan for ``model`` and
    priced. ``cluster`` None: the file's ``autopar:`` header, else the default, with the engine's
    software profile where one exists. The keyword values fill or override what the file says."""
    from autopar.engines import read_config
    from autopar.engines.config import priced_cluster, to_plan
    from autopar.search.driver import load_graph

    cfg = read_config(engine, path).with_overrides(num_gpus=gpus, gpus_per_node=gpus_per_node,
                                                     global_batch_size=global_batch, micro_batch_size=micro_batch,
                                                     seq_len=seq_len)
    notes: list[str] = []  # said once the file is known to describe a plan for this model
    choice = engine_cluster_choice(engine, cluster or cfg.cluster, None, notes.append)
    graph, source = load_graph(_graph_source(model), seq_len=cfg.seq_len, dtype=cfg.dtype, use_cache=use_cache)
    plan = to_plan(cfg, model_file=str(source.path), num_blocks=graph.num_blocks, sha256=source.sha256,
                   cluster_ref=choice.ref, gpus_per_node=cfg.gpus_per_node or choice.cluster.gpus_per_node,
                   default_seq_len=source.declared_seq_len, num_heads=graph.num_heads, num_kv_heads=graph.num_kv_heads)
    for note in notes:
        warn(note)
    # the file's software settings (Megatron's overlaps, buffer precisions) price it, as its degrees do
    est = estimation(model, plan, priced_cluster(choice.cluster, cfg), moe_imbalance=moe_imbalance,
                     use_cache=use_cache, warn=warn)
    return Imported(config=cfg, estimation=est)


def explanation(plan: PlanLike, model: ModelLike | None = None, cluster: "str | Cluster | None" = None, *,
                moe_imbalance: float = 1.0, use_cache: bool = True, warn: Warn = python_warning) -> "Explanation":
    """The facts ``autopar explain`` prints (mesh groups, stages, memory, communication, estimate)
    for ``plan`` on ``cluster`` (default: the plan's profile, as written: explain prices no run)."""
    from autopar.explain.explanation import explain_plan

    p = as_plan(plan)
    source_model, graph, source = plan_graph(p, model, None if isinstance(plan, Plan) else plan, use_cache)
    _warn_if_changed(p, source, warn)
    c = cluster_for(p, cluster)
    if p.cluster.gpus_per_node != c.gpus_per_node:
        warn(f"plan has {p.cluster.gpus_per_node} GPUs per node, profile {c.name} has {c.gpus_per_node}; "
             "links are costed with the profile's")
    return explain_plan(p, graph, c, moe_imbalance)


def explain(plan: PlanLike, model: ModelLike | None = None, cluster: "str | Cluster | None" = None) -> str:
    """The text of ``autopar explain PLAN`` as a string."""
    from autopar.explain.explanation import format_explanation

    return format_explanation(explanation(plan, model, cluster))


def trace(plan: PlanLike, model: ModelLike | None = None, cluster: "str | Cluster | None" = None) -> dict[str, Any]:
    """The predicted pipeline timeline as a Trace Event Format object (``explain --trace``)."""
    from autopar.explain.trace import simulate, trace_json

    ex = explanation(plan, model, cluster)
    return trace_json(ex.plan, simulate(ex.plan, ex.terms, ex.estimate))


def rehearsal(plan: PlanLike, model: ModelLike | None = None, cluster: "str | Cluster | None" = None, *,
              ranks: Sequence[int] | None = None, profile: str | None = None, workers: int | None = None,
              progress: Callable[[str], None] | None = None, use_cache: bool = True,
              warn: Warn = python_warning, why: int = 0) -> "Rehearsal":
    """``autopar rehearse``: the executor applied to ``ranks`` of ``plan`` at its full world size on
    fake tensors over a fake process group (one CPU process per rank, no GPU), one training step
    each under torch's memory tracker, beside the cost model's prediction (``estimation``'s,
    with the same ``cluster``/``profile``); ``why`` > 0: each rank also names the ``why`` largest
    groups of tensors alive at its peak (autopar.rehearse.why). ``ranks`` None: the first rank of every pipeline
    stage. A plan the executor cannot apply at full scale, a plan for another model, or a model
    that reads tensor values is a one-line AutoparError."""
    from autopar.executor.runtime.checks import preflight
    from autopar.rehearse import rehearse

    est = estimation(model, plan, cluster, profile=profile, use_cache=use_cache, warn=warn)
    mf = load_model(est.model)
    preflight(est.plan, mf, est.plan.parallel.world_size)
    return rehearse(est.plan, str(mf.path), est.estimate, est.cluster.name, ranks, progress, workers, why)


def apply_plan(model: ModelLike, plan: PlanLike, *, seed: int = 0, lr: float = 1e-3,
               loss_fn: Any = None) -> "Executable":
    """Apply ``plan`` to the model on this rank (the executor's bring-up, ``executor.start.start``:
    preflight, mesh, ``build_executable``).

    Collective: every rank of an initialised process group (``torchrun`` +
    ``torch.distributed.init_process_group``) of the plan's world size must call it. The weights are
    those of ``torch.manual_seed(seed); build_model()``. Returns the ``Executable`` (``parts``,
    ``optimizer``, ``schedule`` when pp > 1) that ``autopar.executor.runtime.train.train`` drives.

    With tp > 1 the model's output logits are a DTensor sharded on the vocabulary: compute the loss
    (and its backward) inside ``torch.distributed.tensor.parallel.loss_parallel()``, as ``train``
    does, or ``full_tensor()`` them first (an all-gather of the logits).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise AutoparError(
            "apply_plan needs an initialised process group: start under torchrun and call "
            "torch.distributed.init_process_group() first (or use 'autopar run PLAN.yaml')"
        )
    from autopar.executor.runtime.start import StartOptions, start

    p = as_plan(plan)
    return start(p, _model_for(p, model), StartOptions(seed=seed, lr=lr, loss_fn=loss_fn))
