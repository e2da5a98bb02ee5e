"""Which plan dimensions the executor can run on a model, and why not where it cannot.

One function per dimension, each returning None (supported) or a one-line reason. The planner offers
a dimension exactly when its predicate says None, and the executor's preflight refuses a plan for
the same reason, so a plan that ``autopar plan`` writes always runs. When the executor learns to run
a dimension on more models, the predicate here is what changes.

Keys: ``tp`` (tensor parallelism), ``sp`` (Megatron sequence parallelism inside tp), ``pp``
(pipeline stages), ``cp`` (context parallelism), ``zero3`` (FSDP2 fully sharded), ``selective``
(selective recompute of the attention core), ``full`` (full recompute), ``op`` (per-op selective
recompute, autopar.recompute_ops), ``cp_pp`` (context
parallelism and pipeline stages in one plan: each is checked alone by its own key, this one says
whether the two combine), ``ep`` (expert parallelism: what the model must have for any ep > 1; the
degree's own rules, ep dividing the experts and dp x cp, are autopar.layout's ``ep_reason``, checked
where the degree is known: cost/expert.check_ep, the search's ep degrees, the executor's preflight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from autopar.spec.chain_tp import chain_sp_reason, chain_tp_reason
from autopar.spec.model_spec import DIMENSIONS

if TYPE_CHECKING:  # pragma: no cover
    from autopar.spec.model_spec import ModelSpec
    from autopar.spec.tp_plan import TPPlan

# ep's reason for a model without experts (the search says other ep reasons in its rejected line)
NO_EXPERTS = "no mixture of experts in the blocks"



def tp_support(spec: "ModelSpec") -> str | None:
    if spec.kind_tp:
        why = chain_tp_reason(spec.kind_tp)
        if why is not None:
            return f"no tp plan: {why}"
        # every unit kind with shardable layers has a plan (spec/chain_tp.py)
        return _heads_reason(spec) or _replicated_reason([kp.plan for kp in spec.kind_tp])
    if not spec.tp_plan:
        return f"no tp plan: {spec.tp.detail or 'none declared or found'}"
    return _heads_reason(spec) or _replicated_reason([spec.tp])


def _replicated_reason(plans: list["TPPlan"]) -> str | None:
    # The parameters a plan leaves whole on every tp rank, by the block's data flow (spec/tp_replicated.py):
    # summed over tp where they compute on a shard (norms), else each rank's full gradient.
    for plan in plans:
        why = plan.flow.reason(False) if plan.styles and plan.flow is not None else None
        if why is not None:
            return why
    return None


def _heads_reason(spec: "ModelSpec") -> str | None:
    if spec.num_kv_heads == 1 and (spec.num_heads or 0) > 1:
        # tp must divide the KV heads (layout.py); Megatron's replicated-KV tensor parallelism is not run
        return ("one key/value head (multi-query attention): tp must divide the KV heads, and KV heads "
                "replicated over tp ranks are not supported")
    return None


def sp_support(spec: "ModelSpec") -> str | None:
    # The SP hooks (executor/parallel/tensor_parallel.py) take a module's input positionally or by its first
    # forward parameter's name (HF: hidden_states=), and a block's output as a tensor or a tuple
    # whose first element is the hidden state.
    if tp_support(spec):
        return "needs tp"
    if spec.kind_tp:  # blocks that differ: every kind's plan checked as a block's (spec/chain_tp.py)
        why = chain_sp_reason(spec.kind_tp)
        if why is not None:
            return why
    call = spec.probe.block_call
    if not call.first_arg_is_tensor and call.num_args == 0 and not call.kwargs:
        return "the blocks are called without a hidden-state input to split over the sequence"
    # Block 0 run the way the executor's SP hooks run it (spec/sp_check.py): parameters, calls, numbers.
    return spec.sp_check


def pp_support(spec: "ModelSpec") -> str | None:
    # executor/parallel/pipeline_parallel.py runs the model's own forward on every stage with the real
    # micro-batch (any tensors, tuples or dicts), stubs only parameter-holding prologue modules,
    # passes a block's hidden state positionally or by keyword, rebuilds tuple block outputs and
    # ModelOutput results, and places bare parameters on the stages that read them.
    if spec.num_blocks < 2:  # one unit called at every depth says so (spec/chain.py)
        return spec.chain.pp_reason if spec.chain is not None and spec.chain.pp_reason else "fewer than 2 blocks to split"
    if spec.chain is not None and spec.chain.pp_reason:  # the chain's or its block list's (spec/chain.py)
        return spec.chain.pp_reason
    if spec.chain is not None and spec.chain.block_list is None:  # cut at unit inputs: its own requirements
        return None if spec.inputs_are_tensors else "example_inputs() is not a tensor or a tuple of tensors"
    # a block list, also one whose blocks differ (chain.block_list): the block-list pipeline's requirements
    call = spec.probe.block_call
    if not call.first_arg_is_tensor and call.num_args == 0 and not call.kwargs:
        return "the blocks are called without a hidden-state input a stage could receive"
    return None


def cp_support(spec: "ModelSpec") -> str | None:
    if not spec.is_sequence_model:
        return "not a sequence model (no SEQ_LEN)"
    if spec.blocks_kind == "chain":  # the executor installs cp attention in the blocks of one list
        what = f"the blocks differ (a chain of {spec.num_blocks} units)" if spec.num_blocks > 1 else (
            "one unit is called at every depth (a chain of 1 unit)")
        return f"{what}: context parallelism runs the attention of one repeated block list"
    if not spec.inputs_are_token_batch and spec.token_key is None:
        return ("example_inputs() is not one (batch, seq) token tensor, nor a dict of a (batch, seq) "
                "input_ids with only labels and attention_mask of its shape beside it")
    hf = spec.hf_attention
    if spec.core_name is None and hf is None:
        return ("no attention core submodule found (a parameter-free 'core' taking q, k, v) and no "
                "attention dispatched through transformers' attention interface")
    if spec.core_name is not None:
        if not spec.accepts_positions:
            return "forward() takes no positions= argument to place a sequence shard"
        return None
    # transformers attention: executor/parallel/hf_attention.py registers a context-parallel implementation
    # that is exact for full causal attention; the positions travel as position_ids=.
    if not hf.causal:
        return f"the attention ({hf.module}) is not causal; context parallelism here is causal-only"
    if hf.sliding_window is not None:
        return (f"attention within a window or chunk of {hf.sliding_window} tokens (sliding or chunked, on some or all "
                "layers); context parallelism here is full-causal only")
    if hf.dropout > 0:
        return f"attention dropout {hf.dropout} > 0; context-parallel attention has no dropout"
    if not hf.position_ids:
        return "forward() takes no position_ids= argument to place a sequence shard"
    return spec.cp_mixing  # a scan, conv or token shift beside the attention (spec/cp_check.py)


def cp_pp_support(spec: "ModelSpec") -> str | None:
    # The pipeline's CP path (executor/parallel/apply.py, train.py _pipeline_step) shards one token tensor and
    # checks the loss on stage outputs; a dict batch's label loss is checked by running the whole
    # model (executor/context_parallel.is_label_loss), which a pipeline stage cannot.
    if spec.token_key is not None:
        return ("the inputs are a dict (input_ids, labels): context parallelism over a dict batch runs "
                "without pipeline stages")
    return None


def zero3_support(spec: "ModelSpec") -> str | None:
    return None


def selective_support(spec: "ModelSpec") -> str | None:
    # An attention core submodule is checkpointed in place; transformers attention through a
    # registered implementation that runs the original under checkpoint (executor/parallel/hf_attention.py).
    if spec.core_name is None and spec.hf_attention is None:
        return "no attention core submodule and no transformers attention to recompute"
    return None


def full_support(spec: "ModelSpec") -> str | None:
    return None


def op_support(spec: "ModelSpec") -> str | None:
    # The executor checkpoints each repeated block under the per-op policy; the cost model prices
    # the policy from a block's traced ops (cost/compute.py op_saved), which a layer chain's units
    # and a routed layer's expert GEMMs (priced apart, cost/expert.py) do not go through.
    if spec.chain is not None:
        return "a layer chain is priced per unit, not per repeated block; use recompute none or full"
    if spec.moe is not None:
        return (f"the blocks hold a mixture of experts ({spec.moe.experts_path}), whose expert GEMMs are "
                "priced apart from the block's traced ops; use recompute none, selective or full")
    return None


def ep_support(spec: "ModelSpec") -> str | None:
    # executor/parallel/expert_parallel.py shards the experts of every unit that holds them (spec/moe.py:
    # a router's top-k among an nn.ModuleList of experts, or among per-expert stacked / packed weights
    # called with the rows, the top-k indices and their weights, or with rows grouped by expert and the
    # rows per expert) -- every block of a block list, or the
    # units of a chain that hold one same mixture (DeepSeek's MoE layers after its dense first ones);
    # the cost model prices each such unit with the all-to-alls and sharded experts (cost/expert.py).
    moe = spec.moe
    if moe is None and spec.expert_units:
        units = spec.expert_units
        listed = ", ".join(units[:3]) + (", ..." if len(units) > 3 else "")
        return (f"the {len(units)} units holding experts ({listed}) differ in their experts (their path, "
                "count, top-k or size); expert parallelism shards one mixture of experts repeated in every unit "
                "that holds it")
    if moe is None and spec.routed:
        return ("a router chooses among experts (seen on meta), but the experts are neither an nn.ModuleList "
                "of identical modules nor weights stacked per expert, which expert parallelism shards")
    if moe is None:
        return f"{NO_EXPERTS} (no router choosing top-k among expert weights)"
    if moe.experts_kind == "stacked" and moe.call is None and not moe.grouped:
        return (f"the stacked experts ({moe.experts_path}) are called neither with the token rows, the top-k "
                "expert indices and their weights nor with the rows grouped by expert and the rows per expert, "
                "which expert parallelism sends to the ranks holding the experts")
    return None


PREDICATES: dict[str, Callable[["ModelSpec"], str | None]] = {
    "tp": tp_support, "sp": sp_support, "pp": pp_support, "cp": cp_support,
    "zero3": zero3_support, "selective": selective_support, "full": full_support, "op": op_support,
    "cp_pp": cp_pp_support, "ep": ep_support,
}


def support_of(spec: "ModelSpec") -> dict[str, str | None]:
    return {dim: PREDICATES[dim](spec) for dim in DIMENSIONS}
