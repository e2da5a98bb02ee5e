"""Pre-flight checks: everything that can be wrong with (plan, model, world) is found here, before
``init_process_group`` and before any collective, so a bad run is a one-line error, never a hang.
"""

from __future__ import annotations

from torch import nn

from autopar.errors import AutoparError
from autopar.executor.runtime.introspect import ModelSpec, example_shape_check, inspect_model
from autopar.layout import ulysses_reason
from autopar.modelfile import ModelFile
from autopar.plan import DIMENSION_NAMES, Plan

# What the executor calls that older torch builds lack (planning needs none of it: torch >= 2.6 plans):
# FSDP2's replicate (added mid-2025, pytorch/pytorch#158207), FSDP2's sum reduction for expert
# gradients (#155915), DTensor's loss_parallel.
EXECUTOR_TORCH = "2.10"


def torch_support_reason() -> str | None:
    """Why this torch cannot run the executor (None: it can): the APIs it calls, by feature."""
    import torch

    missing = []
    try:
        import torch.distributed._composable.replicate_with_fsdp  # noqa: F401
    except ImportError:
        missing.append("FSDP2's replicate")
    try:
        from torch.distributed.fsdp import FSDPModule

        if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
            missing.append("FSDPModule.set_force_sum_reduction_for_comms")
    except ImportError:
        missing.append("FSDP2 (torch.distributed.fsdp.fully_shard)")
    try:
        from torch.distributed.tensor.parallel import loss_parallel  # noqa: F401
    except ImportError:
        missing.append("DTensor's loss_parallel")
    if not missing:
        return None
    return (f"autopar run needs torch >= {EXECUTOR_TORCH} (this is {torch.__version__}, which lacks "
            f"{', '.join(missing)}); upgrade torch -- planning, estimate and explain work on torch >= 2.6")


def check_world_size(plan: Plan, world_size: int) -> None:
    par = plan.parallel
    if world_size != par.world_size:
        raise AutoparError(
            f"the plan needs {par.world_size} processes (dp {par.dp} x tp {par.tp} x pp {par.pp} x cp {par.cp}) "
            f"but {world_size} were started; run with --nproc-per-node {par.world_size}"
        )


def preflight(plan: Plan, mf: ModelFile, world_size: int | None = None) -> tuple[ModelSpec, list[str]]:
    """Validate the plan against the model file; returns the ModelSpec and warnings to print.

    Errors (AutoparError): wrong world size, block count mismatch, TP/CP/recompute the model cannot
    do, tp not dividing the heads. Warnings: sha256 mismatch (docs/design.md §3: another file version warns).
    """
    warnings: list[str] = []
    reason = torch_support_reason()
    if reason:
        raise AutoparError(reason)
    if world_size is not None:
        check_world_size(plan, world_size)
    model = mf.build("meta")
    spec = inspect_model(mf, model)
    par, where = plan.parallel, str(mf.path)
    if spec.num_blocks != plan.model.num_blocks:
        raise AutoparError(
            f"the plan was made for a model with {plan.model.num_blocks} blocks but {where} has "
            f"{spec.num_blocks} in {spec.blocks_path!r}; re-plan for this model"
        )
    if plan.model.sha256 is not None and plan.model.sha256 != mf.sha256:
        warnings.append(
            f"warning: {where} differs from the file the plan was made for (sha256 mismatch); "
            "the plan may not be optimal"
        )
    if mf.seq_len is not None and mf.seq_len != plan.training.seq_len:
        raise AutoparError(
            f"the plan's training.seq_len = {plan.training.seq_len} but {where} has SEQ_LEN = {mf.seq_len}"
        )
    if par.recompute_blocks is not None and spec.chain is not None:  # per-stage recompute: counts are of repeated blocks
        raise AutoparError(f"parallel.recompute_blocks: {where} is a chain of distinct units, not repeated blocks; "
                           "remove recompute_blocks and set parallel.recompute")
    for dim, used, change in plan.dimensions_used():  # the list estimate checks too (plan.py)
        if used and spec.support_reason(dim):
            raise AutoparError(f"{DIMENSION_NAMES[dim]} cannot run on {where}: {spec.support_reason(dim)}; {change}")
    if par.ep > 1:  # what expert parallelism needs of the model and the other degrees
        from autopar.executor.parallel.expert_parallel import check_expert_parallel

        check_expert_parallel(plan, spec, where, mf)
    if par.tp > 1:  # heads, widths and the block run at this degree: the planner's predicate (layout.TPDegrees)
        reason = spec.tp_degrees.reason(par.tp)
        if reason:
            raise AutoparError(reason)
    if par.cp > 1:
        if spec.token_key is None:
            example_shape_check(mf.example_inputs(1), where, need_sequence=True)
        # The executor repeats K/V heads to the query heads before the all-to-all: only heads count.
        reason = ulysses_reason(par.tp, par.cp, spec.num_heads, None) if par.cp_kind == "ulysses" else None
        if reason:
            raise AutoparError(reason)
    if plan.training.dtype == "fp16":
        # fp16's activation gradients underflow without a loss scaler (GradScaler / FSDP2's
        # ShardedGradScaler), which the executor does not run: refused, not silently degraded
        raise AutoparError("training.dtype fp16 needs loss scaling, which autopar run does not do; "
                           "use bf16 (same memory and speed) or fp32")
    return spec, warnings


def host_available_bytes() -> int | None:
    """The host memory Linux says a new allocation can get (MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_build(model: nn.Module, copies: int, available_bytes: int | None) -> None:
    """A rank takes its part of the whole model built on the host from the seed: ``copies`` whole
    models are on the node at once (``host_reference.host_copies``: the one built, and the file its
    ranks share). Refuse, in one line, a build that cannot fit the node's available host memory --
    where the kernel's OOM killer would otherwise end a rank mid-build with no message. ``model``:
    the meta model (sizes only)."""
    if available_bytes is None:
        return
    each = sum(p.numel() * p.element_size() for p in model.parameters())
    each += sum(b.numel() * b.element_size() for b in model.buffers())
    if each * copies <= available_bytes:
        return
    gib = 2**30
    held = "the model" if copies == 1 else f"{copies} copies of the model (the one built and the one its ranks share)"
    raise AutoparError(
        f"this node builds the whole model on the host before its ranks take their parts and holds {held}: "
        f"{each * copies / gib:,.1f} GiB, with {available_bytes / gib:,.1f} GiB available: use nodes with more "
        "host memory" + (" or start one rank per node" if copies > 1 else ""))
