"""The model spec: the one owner of the facts about a user's model (docs/design.md §2).

``model_spec(model_file)`` builds the model on meta once and reads: where the repeated blocks are
(``spec.blocks``), what runs before and after them (prologue and epilogue, from one meta forward),
heads and KV heads, tied parameters, the vocabulary edges tensor parallelism shards, the TP plan and
where it came from (``spec.tp_plan``), the attention core, and for every plan dimension whether the
executor can run it on this model and, if not, why (``spec.support``, ``spec.support_reason``).
The graph (planner), the profiler and the executor all read this object; none of them has rules of
its own for blocks, heads or the TP plan. Needs torch, never torch.distributed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autopar.errors import ModelFileError
from autopar.modelfile import ModelFile, call_model
from autopar.spec.attention import hf_attention
from autopar.spec.blocks import BlocksNotRun, Probe, find_block_list, heterogeneous_lists, probe_calls
from autopar.spec.chain import Chain, block_list_chain, find_chain
from autopar.spec.chain_tp import KindPlan, chain_kind_plans, chain_tp_reason
from autopar.spec.cp_check import mixing_outside_attention
from autopar.spec.inplace import inplace_outputs
from autopar.spec.meta import tolerant_meta
from autopar.spec.model_spec import DIMENSIONS, ModelSpec
from autopar.spec.moe import MoESpec, moe_of, routes_among
from autopar.spec.short_run import middle_blocks_answered, only_unit_runs
from autopar.spec.sp_check import sp_check
from autopar.spec.spec_inputs import is_int_matrix, spec_inputs
from autopar.spec.support import support_of
from autopar.spec.tp_degree import PlannedUnit, tp_degrees_of
from autopar.spec.tp_infer import Inference, infer_tp
from autopar.spec.tp_plan import (
    TPPlan,
    grad_sums_of,
    model_carried_plan,
    packed_names,
    plan_fused,
    resolve,
    root_prefixes,
)
from autopar.spec.tp_replicated import replicated_flow
from autopar.spec.vocab_edges import embedding_read_late, vocab_edges
from autopar.usercode import model_failed

__all__ = ["DIMENSIONS", "Chain", "ModelSpec", "MoESpec", "TPPlan", "find_core", "model_spec", "spec_of_model", "token_dict_keys"]

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "nhead", "num_attention_heads_per_layer")
_KV_ATTRS = ("num_kv_heads", "num_key_value_heads", "n_head_kv", "n_kv_heads", "num_kv", "multi_query_group_num")


def _config_int(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        v = getattr(obj, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _heads(model: nn.Module, block: nn.Module, flow_heads: Callable[[], tuple[int | None, int | None]]
           ) -> tuple[int | None, int | None]:
    """Heads and KV heads from the model's config, else from attributes of the block's modules
    (``nn.MultiheadAttention.num_heads``, HF attention modules), else from the data flow of block 0
    (``flow_heads``: the reshape of the q and k projections into (..., heads, head_dim))."""
    cfg = getattr(model, "config", None)
    heads = _config_int(cfg, _HEAD_ATTRS) if cfg is not None else None
    kv = _config_int(cfg, _KV_ATTRS) if cfg is not None else None
    if heads is None:
        for mod in block.modules():
            heads = heads or _config_int(mod, _HEAD_ATTRS)
            kv = kv or _config_int(mod, _KV_ATTRS)
        if heads is not None and kv is None:
            # a module names its heads but no KV heads (a plain model's ``n_heads``): the data
            # flow's KV heads, where it sees the same heads (GQA repeated before the attention)
            flow_q, flow_kv = flow_heads()
            kv = flow_kv if flow_q == heads else None
    if heads is None:
        heads, kv = flow_heads()
    return heads, (kv or heads) if heads is not None else None


def find_core(block: nn.Module) -> str | None:
    """Block-relative name of the attention core: a parameter-free submodule named ``core`` or of a
    class ending in ``CoreAttention``, computing attention from (q, k, v) (None: there is none)."""
    for name, mod in block.named_modules():
        if name and (name.rsplit(".", 1)[-1] == "core" or type(mod).__name__.endswith("CoreAttention")):
            if any(True for _ in mod.parameters()):
                continue  # an attention core is parameter-free by contract
            return name
    return None


class _FirstCalls:
    """``calls(module)`` for every module under ``root``, from one meta forward (``run``) recording
    each one's first (args, kwargs), or None where it was not called (or the forward failed: the
    probe's own run already succeeded, so a failure here says nothing new); ``calls.output(module)``
    what that first call returned (None: not called)."""

    def __init__(self, run: Callable[[], Any], root: nn.Module) -> None:
        self.run, self.root, self.ran = run, root, False
        self.seen: dict[int, tuple[tuple, dict]] = {}
        self.outputs: dict[int, Any] = {}

    def _record(self) -> None:
        self.ran = True
        hooks = [h for m in self.root.modules() for h in (
            m.register_forward_pre_hook(lambda m_, args, kwargs: self.seen.setdefault(id(m_), (args, kwargs)),
                                        with_kwargs=True),
            m.register_forward_hook(lambda m_, _args, out: self.outputs.setdefault(id(m_), out)))]
        try:
            self.run()
        except Exception:
            self.seen.clear()
            self.outputs.clear()
        finally:
            for h in hooks:
                h.remove()

    def __call__(self, module: nn.Module) -> tuple[tuple, dict] | None:
        if not self.ran:
            self._record()
        return self.seen.get(id(module))

    def output(self, module: nn.Module) -> Any:
        if not self.ran:
            self._record()
        return self.outputs.get(id(module))


def _first_calls(run: Callable[[], Any], root: nn.Module) -> _FirstCalls:
    """The first call of every module under ``root`` in one meta forward (``_FirstCalls``)."""
    return _FirstCalls(run, root)


def chain_experts(model: nn.Module, units: tuple[str, ...], observed_top_k: Callable[[], tuple[int, int] | None],
                  run: Callable[[], Any]) -> tuple[tuple[str, ...], MoESpec | None]:
    """The units (dotted paths) of a chain holding a mixture of experts (autopar.spec.moe), and
    the MoESpec they all hold -- None where they differ (another path, count, top-k or size). The
    first such unit's experts are read with how the meta forward called them (``MoESpec.call``,
    ``MoESpec.grouped``); the others must match its read without them, which is the same code on
    every unit."""
    if observed_top_k() is None:
        return (), None
    found = [(u, moe_of(model, model.get_submodule(u), observed_top_k)) for u in units]
    holders = tuple(u for u, m in found if m is not None)
    if not holders:
        return (), None
    first = model.get_submodule(holders[0])
    calls = _first_calls(run, first)
    moe = moe_of(model, first, observed_top_k, calls, calls.output)
    # the others are read without their calls: they must match the first's read without its own,
    # which names the same experts as its read with them (a grouped stack's siblings add parameters)
    bare = found[units.index(holders[0])][1]
    if moe is None or any(m != bare for _, m in found if m is not None) or dataclasses.replace(
            moe, call=None, grouped=(), grouped_widths=(), params_per_expert=bare.params_per_expert) != bare:
        return holders, None
    return holders, moe


def _tied(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return tuple(tuple(v) for v in aliases.values() if len(v) > 1)


def _bare_params(model: nn.Module, blocks_path: str, probe: Probe) -> tuple[str, ...]:
    """Parameters registered directly on the root or on an ancestor of the block list: no prologue
    or epilogue module owns them, so a pipeline chunk cannot tell which stage needs them."""
    path = blocks_path.split(".")
    out = []
    for depth in range(len(path)):
        prefix = ".".join(path[:depth])
        owner = model.get_submodule(prefix) if prefix else model
        for name, _ in owner.named_parameters(recurse=False):
            out.append(f"{prefix}.{name}" if prefix else name)
    return tuple(out)


def _tp_plan_of(mf: ModelFile, model: nn.Module, blocks_path: str, block: nn.Module,
                infer: Callable[[], Inference], siblings: frozenset[str] = frozenset()) -> TPPlan:
    """The TP plan by precedence: declared, carried by the model, inferred (module docstring of
    autopar.spec.tp_plan; ``infer``: the data-flow inference of autopar.spec.tp_infer).
    ``siblings``: unit-relative module names of a chain's other unit kinds, so that a declared
    pattern naming a layer of another kind is not an error for this one."""
    where = str(mf.path)
    prefixes = root_prefixes(model)
    names = frozenset(n for n, _ in model.named_modules() if n) | siblings
    if mf.tp_plan is not None:
        styles, notes = resolve(mf.tp_plan, block, blocks_path, prefixes, strict=True, where=where, model_names=names)
        return TPPlan(styles=styles, source="declared", detail="the model file's tp_plan", dropped=tuple(notes))
    carried, label = model_carried_plan(model)
    if carried is not None:
        styles, notes = resolve(carried, block, blocks_path, prefixes, strict=False, where=where, model_names=names)
        sums, missing = grad_sums_of(carried, block, blocks_path, prefixes, getattr(model, "config", None))
        if missing and styles:  # its sharded heads would train the layer on partial gradients
            return TPPlan(styles={}, source="none", detail=f"the model's {label} sums the gradient of "
                          f"{', '.join(missing)} over tp ranks, and that width is not in the config")
        notes = [n for n in notes if n.split(":", 1)[0] not in sums]  # run: the gradient summed (executor)
        if styles and not sums and any(n.endswith("is not run by autopar") for n in notes):
            # Part of the carried plan uses styles autopar does not run (GLM-4's gate_up_proj
            # colwise_gather_output): when the data flow shards every layer the carried plan
            # shards, the same way, and more, its plan -- checked as a whole -- replaces it.
            inferred = infer().plan
            if len(inferred.styles) > len(styles) and all(inferred.styles.get(n) == s for n, s in styles.items()):
                return dataclasses.replace(inferred, detail=f"{inferred.detail}; the model's {label} covers "
                                           f"{len(styles)} of these layers", dropped=tuple(notes) + inferred.dropped)
        if styles:
            # As the model's authors wrote it: colwise is sharded as laid out (factor 1), only
            # packed_colwise layers are de-interleaved by the width rule (spec/tp_plan.packed_names).
            packed = packed_names(carried, block, blocks_path, prefixes)
            fused = {n: 1 for n, s in styles.items() if s == "colwise" and n not in packed}
            return TPPlan(styles=styles, source="model", detail=label, dropped=tuple(notes), fused=fused,
                          grad_sums=sums)
        # HF styles autopar does not run (Phi-3's colwise_gather_output): the data flow may still
        # show pairs it can run.
        inferred = infer().plan
        if inferred.styles:
            return dataclasses.replace(inferred, dropped=tuple(notes) + inferred.dropped)
        return TPPlan(styles={}, source="none", detail=f"the model's {label} has no entry autopar can run, and "
                      f"{inferred.detail}", dropped=tuple(notes) + inferred.dropped)
    inferred = infer().plan
    if inferred.styles:
        return inferred
    return TPPlan(styles={}, source="none", detail=f"none declared (tp_plan) or carried by the model (_tp_plan), "
                  f"and {inferred.detail}", dropped=inferred.dropped)


_CACHE: dict[tuple[str, str], ModelSpec] = {}


def model_spec(mf: ModelFile, model: nn.Module | None = None) -> ModelSpec:
    """The ModelSpec of ``mf`` (cached per file and content). ``model``: an already built meta model
    of the file, to save a build."""
    key = (str(mf.path.resolve()), mf.sha256)
    if key not in _CACHE:
        _CACHE[key] = spec_of_model(mf, model if model is not None else mf.build("meta"))
    return _CACHE[key]


def spec_of_model(mf: ModelFile, model: nn.Module, exclude: frozenset[str] = frozenset()) -> ModelSpec:
    """Read the spec of ``model`` (built on meta from ``mf``); see the module docstring. ``exclude``:
    block lists already found not to be the model's blocks (the forward did not call all of them)."""
    where = str(mf.path)
    try:
        blocks_path = find_block_list(model, mf.pipeline_blocks, exclude)
    except ModelFileError as exc:
        raise ModelFileError(f"{where}: {exc}") from None
    inputs = mf.example_inputs(1, "meta")
    routing: list[tuple[int, int]] = []  # (top_k, experts) of the router topk the probe saw

    def observed() -> tuple[int, int] | None:
        return routing[0] if routing else None

    blocks_for_run = model.get_submodule(blocks_path) if blocks_path is not None else None

    def run_on(batch: Any) -> Any:
        shortened = middle_blocks_answered(blocks_for_run) if blocks_for_run is not None else contextlib.nullcontext()
        with tolerant_meta() as mode, shortened:
            out = call_model(model, batch)
        if mode.routing is not None and not routing:
            routing.append((mode.routing.top_k, mode.routing.num_experts))
        return out

    inputs = spec_inputs(inputs, run_on)  # tokens cut short where a full-length forward loops too long

    def run() -> Any:
        return run_on(inputs)

    if blocks_path is None:
        chain = _meta_call(where, lambda: find_chain(model, run, exclude))
        experts = frozenset(c for c in (chain.containers if chain is not None else ())
                            if routes_among(model, c, observed()))
        if experts:  # a layer's experts, which a router picks among, are no units of the model's chain
            chain = _meta_call(where, lambda: find_chain(model, run, exclude | experts))
        if chain is not None:
            spec = _chain_spec(mf, model, chain, inputs, run, observed)
            units, moe = chain_experts(model, chain.units, observed, run)
            return _with_support(dataclasses.replace(spec, expert_units=units, moe=moe, routed=bool(routing)))
        mixed = heterogeneous_lists(model)
        hint = (f" ({', '.join(mixed[:3])} hold blocks whose parameter shapes differ)" if mixed else "")
        raise ModelFileError(
            f"{where}: found no list of repeated blocks (an nn.ModuleList, nn.Sequential or numbered "
            f"nn.ModuleDict of identical blocks){hint}; set pipeline_blocks = '<attribute name>'")
    blocks = model.get_submodule(blocks_path)
    block = blocks[0]
    try:
        probe = probe_calls(model, blocks_path, run)
    except BlocksNotRun as exc:
        if mf.pipeline_blocks is not None:
            raise ModelFileError(f"{where}: {exc}") from None
        return spec_of_model(mf, model, exclude | {exc.blocks_path})
    except ModelFileError as exc:
        raise ModelFileError(f"{where}: {exc}") from None
    except Exception as exc:  # the user's forward on meta
        raise model_failed(where, "on the meta device", exc) from None
    if mf.pipeline_blocks is None and routes_among(model, blocks_path, observed()):
        # the only identical list of a model whose layers differ can be a layer's experts: a router
        # picks among them, the forward does not pass its hidden state through them in turn
        return spec_of_model(mf, model, exclude | {blocks_path})
    memo: list[Inference] = []

    def infer() -> Inference:
        if not memo:
            memo.append(infer_tp(model, block, run))
        return memo[0]

    tp = _with_flow(_tp_plan_of(mf, model, blocks_path, block, infer), block, run)
    heads, kv = _heads(model, block, lambda: (infer().heads, infer().kv_heads))
    emb, head = vocab_edges(model, blocks_path, probe)
    if emb is not None and embedding_read_late(model, emb, head, blocks[len(blocks) - 1], run):
        emb = None  # its table is read whole after the blocks: kept replicated (spec/vocab_edges.py)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    flat = tree_flatten(inputs)[0]
    tensors_only = isinstance(inputs, torch.Tensor) or (
        isinstance(inputs, tuple) and all(isinstance(v, torch.Tensor) for v in inputs))
    token_batch = isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and not inputs.is_floating_point()
    token_key, labels_key = token_dict_keys(inputs)
    block_calls = _first_calls(run, block)  # one recording forward, shared by the readers below
    moe = moe_of(model, block, observed, block_calls, block_calls.output)
    degrees = tp_degrees_of(heads, kv, (PlannedUnit(prefix="", module=block, styles=tp.styles,
                                                    local_attrs=tp.local_attrs, container=blocks_path),), block_calls)
    # A block without TP has no SP check; an MoE block's routed part runs on the sequence shard.
    sp_why, keyword_parents = (_sp_check_with_experts(block, tp, moe, run) if tp.styles else (None, ()))
    hf = hf_attention(model, block, mf.seq_len)
    cp_mixing = (mixing_outside_attention(model, blocks_path, hf.module, inputs)
                 if hf is not None and mf.seq_len is not None and (token_batch or token_key) else None)
    spec = ModelSpec(
        blocks_path=blocks_path, num_blocks=len(blocks), blocks_kind=type(blocks).__name__, tp=tp,
        core_name=find_core(block), num_heads=heads, num_kv_heads=kv,
        accepts_positions="positions" in params, vocab_embedding=emb, vocab_head=head, tied=_tied(model),
        probe=probe, sp_parents_keyword=keyword_parents,
        bare_params=_bare_params(model, blocks_path, probe), inputs_are_tensors=tensors_only and bool(flat),
        inputs_are_token_batch=token_batch, token_key=token_key, labels_key=labels_key,
        is_sequence_model=mf.seq_len is not None, hf_attention=hf, cp_mixing=cp_mixing, routed=bool(routing),
        notes=tp.dropped,
        moe=moe, sp_check=sp_why, tp_degrees=degrees, tp_inplace_outputs=inplace_outputs(block, tp.styles, run) if tp.styles else (),
        chain=_meta_call(where, lambda: block_list_chain(model, blocks_path, run)) if isinstance(blocks, nn.Sequential) else None,
    )
    return _with_support(spec)


def token_dict_keys(inputs: Any) -> tuple[str | None, str | None]:
    """("input_ids", "labels" or None) when ``inputs`` is the batch a Hugging Face causal LM takes
    from the HF Trainer: a mapping whose ``input_ids`` is a 2-d integer (batch, seq) tensor, with
    optionally ``labels`` of the same shape (integers) and an ``attention_mask`` of the same shape
    (which the executor requires to be all ones at run time and then drops); (None, None) for any
    other input, a mapping with any other key included. Shapes only: meta inputs have no values."""
    if not isinstance(inputs, Mapping) or not is_int_matrix(inputs.get("input_ids")):
        return None, None
    shape = inputs["input_ids"].shape
    for key, value in inputs.items():
        if key == "input_ids":
            continue
        if key == "labels" and is_int_matrix(value) and value.shape == shape:
            continue
        if key == "attention_mask" and isinstance(value, torch.Tensor) and value.shape == shape:
            continue
        return None, None
    return "input_ids", "labels" if "labels" in inputs else None


def _meta_call(where: str, fn: Any) -> Any:
    """``fn()`` (a meta probe of the user's forward), its failures as one-line ModelFileErrors."""
    try:
        return fn()
    except ModelFileError as exc:
        raise ModelFileError(str(exc) if str(exc).startswith(where) else f"{where}: {exc}") from None
    except Exception as exc:  # the user's forward on meta
        raise model_failed(where, "on the meta device", exc) from None


def _with_flow(plan: TPPlan, unit: nn.Module, run: Callable[[], Any]) -> TPPlan:
    """``plan`` with the data flow of its replicated modules (spec/tp_replicated.py) read on ``unit``."""
    if not plan.styles:
        return plan
    return dataclasses.replace(plan, flow=replicated_flow(unit, plan.styles, plan.grad_sums, run))


def _sp_check_with_experts(unit: nn.Module, plan: TPPlan, moe: MoESpec | None, run: Callable[[], Any]
                           ) -> tuple[str | None, tuple[str, ...]]:
    """spec/sp_check.py's check of ``unit`` under ``plan``, its mixture of experts ``moe`` (None:
    dense) run on the sequence shard -- refused where the plan shards the experts (their Linears
    would see the shard routed to them, not a gathered input) or they are the unit's own children."""
    if moe is None:
        return sp_check(unit, plan.styles, plan_fused(unit, plan), plan.local_attrs, run, flow=plan.flow)
    owner = moe.experts_path.rpartition(".")[0]
    if any(n == path or n.startswith(path + ".") for path in moe.paths for n in plan.styles):
        return (f"the tp plan shards the experts ({moe.experts_path}): sequence parallelism routes each tp "
                "rank's sequence shard to whole experts"), ()
    if not owner:
        return (f"the experts ({moe.experts_path}) are the block's own children: sequence parallelism runs a "
                "mixture of experts module on the sequence shard"), ()
    return sp_check(unit, plan.styles, plan_fused(unit, plan), plan.local_attrs, run, moe_module=owner, flow=plan.flow)


def _chain_spec(mf: ModelFile, model: nn.Module, chain: Chain, inputs: Any, run: Callable[[], Any],
                observed: Callable[[], tuple[int, int] | None] = lambda: None) -> ModelSpec:
    """The spec of a model without a repeated block list: its layer chain (spec/chain.py).
    ``blocks_path`` names the container of the first unit (what block-list readers index);
    ``num_blocks`` counts the chain's units. ``spec.tp`` (one block's plan) stays empty; a chain
    read as one module list gets a plan per unit kind (``kind_tp``, spec/chain_tp.py)."""
    first = chain.units[0].rsplit(".", 1)[0]
    probe = chain.probe
    heads, kv = _heads(model, model.get_submodule(chain.units[0]), lambda: (None, None))  # no block to infer from
    emb, head = vocab_edges(model, first, probe)
    if emb is not None and embedding_read_late(model, emb, head, model.get_submodule(chain.units[-1]), run):
        emb = None  # its table is read whole after the blocks: kept replicated (spec/vocab_edges.py)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    tensors_only = isinstance(inputs, torch.Tensor) or (
        isinstance(inputs, tuple) and bool(inputs) and all(isinstance(v, torch.Tensor) for v in inputs))
    lists = ", ".join(chain.containers[:4]) + (", ..." if len(chain.containers) > 4 else "")
    kinds, source = (), "none"
    if chain.block_list is not None:
        relative = frozenset(n for u in chain.units for n, _ in model.get_submodule(u).named_modules() if n)
        block_list = model.get_submodule(chain.block_list)

        def focused(unit: nn.Module, probe: Callable[[Callable[[], Any]], Any]) -> Any:
            """``probe(run)`` with only block 0 and ``unit`` of the list running their code
            (short_run.only_unit_runs); the whole run where the answered blocks do not fit."""
            def unit_run() -> Any:
                with only_unit_runs(block_list, unit):
                    return run()

            try:
                # the probes say why they fail rather than raise (infer_tp): try the answered run first
                unit_run()
            except Exception:  # noqa: BLE001 - an answered block's object the model's code cannot take
                return probe(run)  # Hiera's stages widen: stage 0's output answered for stage 3's
            return probe(unit_run)

        def resolve_unit(container: str, unit: nn.Module) -> TPPlan:
            plan = _tp_plan_of(mf, model, container, unit,
                               lambda: focused(unit, lambda r: infer_tp(model, unit, r)), relative)
            return focused(unit, lambda r: _with_flow(plan, unit, r))

        kinds = _meta_call(str(mf.path), lambda: chain_kind_plans(
            model, chain, resolve_unit,
            lambda unit, plan: focused(unit, lambda r: inplace_outputs(unit, plan.styles, r)),
            lambda unit, plan: focused(unit, lambda r: _sp_check_with_experts(
                unit, plan, moe_of(model, unit, observed) if observed() is not None else None, r)[0])))
        why = chain_tp_reason(kinds)
        if why is None:  # every kind has a plan; whether tp runs is spec/support.py's tp predicate
            why = "plans per unit kind: " + "; ".join(k.describe() for k in kinds)
            # where the plans came from: one source, or "declared" > "model" > "inferred" of the kinds'
            source = next(src for src in ("declared", "model", "inferred") if any(k.plan.source == src for k in kinds))
    else:
        why = (f"no single list of identical blocks (a chain of {chain.num_units} units in {lists}); tp plans apply "
               "to the blocks of one module list")
    tp = TPPlan(styles={}, source=source, detail=why)
    # one unit of each kind, run at every degree the rules allow as the forward called it
    planned = tuple(PlannedUnit(prefix=f"{k.unit}.", module=model.get_submodule(k.unit), styles=k.plan.styles,
                                local_attrs=k.plan.local_attrs, container=k.unit.rsplit(".", 1)[0]) for k in kinds)
    rule_heads, rule_kv = _sharded_heads(model, kinds) if _config_int(getattr(model, "config", None),
                                                                       _HEAD_ATTRS) is None else (heads, kv)
    degrees = tp_degrees_of(rule_heads, rule_kv, planned, _first_calls(run, model) if planned else None)
    return ModelSpec(tp_degrees=degrees,
        blocks_path=first, num_blocks=chain.num_units, blocks_kind="chain", tp=tp, core_name=None,
        num_heads=heads, num_kv_heads=kv, accepts_positions="positions" in params, vocab_embedding=emb,
        vocab_head=head, tied=_tied(model), probe=probe, bare_params=tuple(chain.bare),
        inputs_are_tensors=tensors_only, inputs_are_token_batch=False, is_sequence_model=mf.seq_len is not None,
        notes=(f"chain: {chain.num_units} units in {', '.join(chain.containers)}",), chain=chain, kind_tp=kinds,
    )


def _sharded_heads(model: nn.Module, kinds: tuple[KindPlan, ...]) -> tuple[int | None, int | None]:
    """The heads and KV heads tp must divide in a chain whose config names no one head count (Hiera's
    heads per stage, 1 to 8): those of every unit kind's attention module whose layers its plan
    shards (a module naming its heads, ``_HEAD_ATTRS``), taken together (their greatest common
    divisor); None where no kind shards an attention module. A kind whose plan leaves its attention
    whole (Hiera's first stage: one head, its MLP sharded) puts no head count in the rule."""
    heads: list[int] = []
    kvs: list[int] = []
    for k in kinds:
        for name, mod in model.get_submodule(k.unit).named_modules():
            h = _config_int(mod, _HEAD_ATTRS)
            if h and name and any(layer.startswith(name + ".") for layer in k.plan.styles):
                heads.append(h)
                kvs.append(_config_int(mod, _KV_ATTRS) or h)
    if not heads:
        return None, None
    return math.gcd(*heads), math.gcd(*kvs)


def _with_support(spec: ModelSpec) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, support=support_of(spec))
