"""The Python API for notebooks and scripts: the same steps the CLI takes, as functions.

    import autopar
    plan = autopar.plan("examples/gpt.py", gpus=64, cluster="a100-80g")   # search -> Plan
    est = autopar.estimate("examples/gpt.py", plan)                        # cost model -> Estimate
    print(autopar.explain(plan))                                           # the explain tables
    exe = autopar.apply_plan("examples/gpt.py", plan)                      # inside torchrun only

``model`` is a model file (a path, or a loaded ``autopar.modelfile.ModelFile``) as docs/design.md §3
defines it: a plan records the file it was made for, and ``autopar run`` rebuilds the model from
it on every rank, so an in-memory ``nn.Module`` cannot be planned or run (it is refused with a
one-line error saying so). ``plan`` arguments may be a ``Plan`` or a path to a plan YAML.

Every user error is an ``autopar.errors.AutoparError`` (one line). Heavy imports (torch, the
search, the executor) happen inside the functions, so ``import autopar`` stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from autopar.errors import AutoparError
from autopar.plan import Plan, load_plan

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster import Cluster
    from autopar.cost.step import Estimate
    from autopar.executor.apply import Executable
    from autopar.explain.explanation import Explanation
    from autopar.graph import ModelGraph
    from autopar.modelfile import ModelFile

ModelLike = Any  # str | os.PathLike | ModelFile
PlanLike = Any  # Plan | str | os.PathLike

_SPACE_KNOBS = ("zero_stages", "recompute_modes", "schedules", "cp_kinds", "max_virtual_stages", "dp_degrees",
                "tp_degrees", "pp_degrees", "cp_degrees", "sequence_parallel", "virtual_stages")


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
    """The plan's ``model.file``, taken relative to the plan's directory when it is not found as is."""
    p = Path(plan.model.file)
    if plan_path is not None and not p.is_absolute() and not p.exists():
        beside = Path(plan_path).parent / p
        if beside.exists():
            return str(beside)
    return plan.model.file


def _model_for(plan: Plan, model: ModelLike | None, plan_path: Any = None) -> "ModelFile":
    return load_model(model if model is not None else plan_model_path(plan, plan_path))


def model_graph(model: ModelLike, plan: Plan) -> "ModelGraph":
    """The graph of ``model`` measured at the plan's sequence length and dtype."""
    from autopar.graph import build_graph

    return build_graph(load_model(model), seq_len=plan.training.seq_len, dtype=plan.training.dtype)


def cluster_for(plan: Plan, cluster: "str | Cluster | None" = None) -> "Cluster":
    """The cluster profile to cost ``plan`` on: ``cluster`` (name, path or Cluster), else the plan's."""
    from autopar.cluster import Cluster, load_cluster

    if isinstance(cluster, Cluster):
        return cluster
    return load_cluster(cluster or plan.cluster.profile)


def plan(model: ModelLike, gpus: int, cluster: str = "a100-80g", *, gpus_per_node: int | None = None,
         global_batch: int | None = None, micro_batch: Sequence[int] = (1, 2, 4, 8), seq_len: int | None = None,
         dtype: str = "bf16", optimizer: str = "adam", **knobs: Any) -> Plan:
    """Search the fastest plan of ``model`` on ``gpus`` GPUs that fits memory (``autopar plan``).

    ``knobs`` restrict the search space (``search.space.SearchSpace`` fields): zero_stages,
    recompute_modes (add "mixed" for per-stage counts), schedules, cp_kinds, max_virtual_stages, dp/tp/pp/cp_degrees,
    sequence_parallel, virtual_stages (``autopar plan --tp 8 ...`` is the CLI's form). Returns the best plan with its
    ``prediction``; raises ``InfeasibleError`` when nothing fits.
    """
    from autopar.cluster import load_cluster
    from autopar.search.driver import search_plans

    unknown = sorted(set(knobs) - set(_SPACE_KNOBS))
    if unknown:
        raise AutoparError(f"unknown search knob {unknown[0]!r}; allowed: {', '.join(_SPACE_KNOBS)}")
    knobs = {k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in knobs.items()}
    if isinstance(micro_batch, int):
        micro_batch = (micro_batch,)
    prof = load_cluster(cluster)
    # A path goes to the driver as it is: on a graph-cache hit the model file is not even imported.
    source = model if isinstance(model, (str, os.PathLike)) else load_model(model)
    found = search_plans(source, gpus=gpus, cluster=prof,
                         cluster_ref=prof.name if not Path(cluster).suffix else cluster,
                         gpus_per_node=gpus_per_node, global_batch=global_batch, micro_batches=micro_batch,
                         seq_len=seq_len, dtype=dtype, optimizer=optimizer, top_k=1, knobs=knobs)
    return found.plans[0]


def estimate(model: ModelLike | None, plan: PlanLike, cluster: "str | Cluster | None" = None) -> "Estimate":
    """The cost model's prediction of ``plan`` (``autopar estimate``). ``model`` None: the plan's
    model file. ``estimate_json(autopar.estimate(...))`` is the ``--json`` contract object."""
    from autopar.cost.estimate import estimate_plan

    p = as_plan(plan)
    graph = model_graph(_model_for(p, model, plan if not isinstance(plan, Plan) else None), p)
    return estimate_plan(p, graph, cluster_for(p, cluster))


def explanation(plan: PlanLike, model: ModelLike | None = None,
                cluster: "str | Cluster | None" = None) -> "Explanation":
    """The facts ``autopar explain`` prints (mesh groups, stages, memory, communication, estimate)."""
    from autopar.explain.explanation import explain_plan

    p = as_plan(plan)
    graph = model_graph(_model_for(p, model, plan if not isinstance(plan, Plan) else None), p)
    return explain_plan(p, graph, cluster_for(p, cluster))


def explain(plan: PlanLike, model: ModelLike | None = None, cluster: "str | Cluster | None" = None) -> str:
    """The text of ``autopar explain PLAN`` as a string."""
    from autopar.explain.explanation import format_explanation

    return format_explanation(explanation(plan, model, cluster))


def trace(plan: PlanLike, model: ModelLike | None = None, cluster: "str | Cluster | None" = None) -> dict[str, Any]:
    """The predicted pipeline timeline as a Trace Event Format object (``explain --trace``)."""
    from autopar.explain.trace import simulate, trace_json

    ex = explanation(plan, model, cluster)
    return trace_json(ex.plan, simulate(ex.plan, ex.terms, ex.estimate))


def apply_plan(model: ModelLike, plan: PlanLike, *, seed: int = 0, lr: float = 1e-3,
               loss_fn: Any = None) -> "Executable":
    """Apply ``plan`` to the model on this rank (the executor's ``build_executable``).

    Collective: every rank of an initialised process group (``torchrun`` +
    ``torch.distributed.init_process_group``) of the plan's world size must call it. The weights are
    those of ``torch.manual_seed(seed); build_model()``. Returns the ``Executable`` (``parts``,
    ``optimizer``, ``schedule`` when pp > 1) that ``autopar.executor.train.train`` drives.

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
    from autopar.executor.apply import build_executable
    from autopar.executor.checks import preflight
    from autopar.executor.mesh import build_mesh, device_for_rank

    p = as_plan(plan)
    mf = _model_for(p, model)
    spec, _warnings = preflight(p, mf, dist.get_world_size())
    mesh = build_mesh(p, device_for_rank())
    return build_executable(p, mf, spec, mesh, seed=seed, lr=lr, loss_fn=loss_fn or mf.loss_fn)
