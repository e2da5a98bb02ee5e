"""Which plan dimensions the executor can run on a model, and why not where it cannot.

One function per dimension, each returning None (supported) or a one-line reason. The planner offers
a dimension exactly when its predicate says None, and the executor's preflight refuses a plan for
the same reason, so a plan that ``autopar plan`` writes always runs. When the executor learns to run
a dimension on more models, the predicate here is what changes.

Keys: ``tp`` (tensor parallelism), ``sp`` (Megatron sequence parallelism inside tp), ``pp``
(pipeline stages), ``cp`` (context parallelism), ``zero3`` (FSDP2 fully sharded), ``selective``
(selective recompute of the attention core), ``full`` (full recompute).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    from autopar.spec import ModelSpec

DIMENSIONS = ("tp", "sp", "pp", "cp", "zero3", "selective", "full")


def tp_support(spec: "ModelSpec") -> str | None:
    if not spec.tp_plan:
        return f"no tp plan: {spec.tp.detail or 'none declared or found'}"
    return None


def sp_support(spec: "ModelSpec") -> str | None:
    if tp_support(spec):
        return "needs tp"
    if not spec.probe.block_call.first_arg_is_tensor:
        return "the blocks take their input as a keyword argument; sequence parallelism needs it positional"
    if spec.sp_parents_keyword:
        return (f"{spec.sp_parents_keyword[0]} takes its input as a keyword argument; sequence parallelism "
                "gathers the first positional input")
    return None


def pp_support(spec: "ModelSpec") -> str | None:
    if spec.num_blocks < 2:
        return "fewer than 2 blocks to split"
    if not spec.inputs_are_tensors:
        return "example_inputs() is not a tensor or a tuple of tensors"
    if not spec.probe.block_call.first_arg_is_tensor:
        return "the blocks take their input as a keyword argument"
    if spec.probe.block_output != "Tensor":
        return f"a block returns a {spec.probe.block_output}, not a tensor"
    bad = [n for n, t in spec.probe.prologue if t != "Tensor"]
    if bad:
        return f"prologue module {bad[0]} returns a non-tensor"
    if spec.bare_params:
        return f"parameter {spec.bare_params[0]} is not inside a submodule the pipeline can place"
    return None


def cp_support(spec: "ModelSpec") -> str | None:
    if not spec.is_sequence_model:
        return "not a sequence model (no SEQ_LEN)"
    if spec.core_name is None:
        return "no attention core submodule found (a parameter-free 'core' taking q, k, v)"
    if not spec.accepts_positions:
        return "forward() takes no positions= argument to place a sequence shard"
    if not spec.inputs_are_token_batch:
        return "example_inputs() is not one (batch, seq) token tensor"
    return None


def zero3_support(spec: "ModelSpec") -> str | None:
    return None


def selective_support(spec: "ModelSpec") -> str | None:
    if spec.core_name is None:
        return "no attention core submodule to recompute"
    return None


def full_support(spec: "ModelSpec") -> str | None:
    return None


PREDICATES: dict[str, Callable[["ModelSpec"], str | None]] = {
    "tp": tp_support, "sp": sp_support, "pp": pp_support, "cp": cp_support,
    "zero3": zero3_support, "selective": selective_support, "full": full_support,
}


def support_of(spec: "ModelSpec") -> dict[str, str | None]:
    return {dim: PREDICATES[dim](spec) for dim in DIMENSIONS}
