"""Expert parallelism (plan ``parallel.ep``): the experts of every MoE block (every block of a block
list, or the units of a layer chain that hold them: DeepSeek's layers after its dense first ones) sharded over
``ep`` ranks, tokens sent to their experts and back with an all-to-all of uneven splits.

Layout (Megatron-Core's and torchtitan's; autopar.layout owns it, with the rules on ep): the ep
ranks are drawn from the dp x cp ranks, ep innermost. Ranks are ``[pp, dp, cp, tp]``; flattening
(dp, cp) to one index f, a rank's ep index is f mod ep and its expert-data-parallel (edp) index
f div ep. Each ep group holds all E experts, E/ep per rank (rank i: experts i*E/ep ..
(i+1)*E/ep - 1); the dp*cp/ep ranks with the same ep index hold the same experts and reduce their
gradients together. Attention, norms and the router stay as the other degrees say (replicated over
dp x cp).

Gradient scale: every rank's loss is its share of the step (the dp x cp average the non-expert
gradients get), and the all-to-all's backward brings each expert the gradients of the tokens of
its whole ep group, so an expert's gradient is the *sum* over its edp ranks divided by dp*cp
(FSDP2's ``set_gradient_divide_factor(dp*cp)`` at ZeRO >= 1; the optimizer's step pre-hook at ZeRO 0,
where DDP is told to leave the expert parameters alone).

Two kinds of experts (``autopar.spec.moe``):

* stacked (Hugging Face 5 ``MixtralExperts``, ``Qwen2MoeExperts``, ``GptOssExperts`` with its
  per-expert biases, a plain-torch grouped-experts module: parameters per expert, expert first; or
  packed along the rows, E x f, as DBRX's ``w1`` / ``v1`` / ``w2``), called with the token rows,
  the top-k expert indices and their weights, at whatever positions or keywords the spec saw
  (``MoESpec.call``): the module keeps its own experts' rows of every parameter and its forward
  becomes dispatch -> the model's own expert code on the received rows (top-1 to a local expert,
  weight 1) -> combine; the routing weights are applied on the sending rank, so the expert code
  must be linear in its weights (each expert's output times its weight, as all of these are).
* an ``nn.ModuleList`` of expert modules called by the MoE module's own routing code: that code is
  opaque, so the MoE module runs twice per forward. The first run records which expert is called
  on which rows (experts answer zeros); the recorded rows are dispatched at once, the local experts
  run, the results come back, and the second run replays the same calls with the real outputs, so
  the module's own weighting and scatter build the output (and its autograd graph). This needs a
  deterministic router (no jitter in training) and experts mapping the width to itself; the router
  and the glue run twice, the experts once.
* stacked experts called with their rows already grouped by expert and the rows per expert (JetMoE's
  ``ParallelExperts``, ``MoESpec.grouped``): the MoE module's own code routes, gates and scatters, so
  each such stack (an up and a down projection) sends its grouped rows to their experts and returns
  its results in the order of its rows (expert_grouped.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import AutoparError
from autopar.executor.parallel.expert_exchange import (
    ExpertGroups,
    _arg,
    _touch,
    _with,
    exchange,
    keep_local_experts,
    routing_counts,
)
from autopar.executor.parallel.expert_grouped import shard_grouped
from autopar.layout import EXPERT_DIMS


def check_expert_parallel(plan: Any, spec: Any, where: str, mf: Any) -> None:
    """Preflight: the one-line reason ``plan``'s ep cannot run on the model of ``spec``, if any --
    the model's (spec/support.py ``ep``, the one the search and ``estimate`` read) and the degree's
    (autopar.layout's ``ep_reason``, the search's and ``estimate``'s too)."""
    par = plan.parallel
    if par.ep == 1:
        return
    reason = spec.support_reason("ep")
    if reason:
        raise AutoparError(f"expert parallelism cannot run on {where}: {reason}; plan with ep = 1")
    reason = par.layout.expert_reason(spec.moe.num_experts)
    if reason:
        raise AutoparError(f"{where}: {reason}")


# ---------------------------------------------------------------- groups


def expert_groups(plan: Any, spec: Any, device: torch.device) -> ExpertGroups:
    """Collective: every rank must call it (DeviceMesh makes the groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = plan.parallel.layout
    mesh = init_device_mesh(device.type, layout.expert_shape, mesh_dim_names=EXPERT_DIMS)
    pool = None
    if layout.folds_tp:  # the moe_dp axis: every rank of a pipeline stage (dp x cp x tp, contiguous)
        pool = init_device_mesh(device.type, (layout.pp, layout.size("moe_dp")), mesh_dim_names=("pp", "moe_dp"))["moe_dp"]
    return ExpertGroups(mesh=mesh, ep=layout.size("ep"), edp=layout.size("edp"), num_experts=spec.moe.num_experts,
                        grad_divide=layout.size("dp_cp"), pool_mesh=pool)


# ---------------------------------------------------------------- stacked experts (HF 5)


def _stacked_forward(groups: ExpertGroups, original: Callable, call: tuple[str, str, str]) -> Callable:
    """The experts module's forward under ep: its call's (rows, top-k indices, top-k weights) --
    at the places ``call`` names (autopar.spec.moe.MoESpec.call) -- dispatched, the model's own
    expert code run on the received rows (each row top-1 to its local expert, weight 1), combined,
    weighted on the sending rank and summed per token in the shape of the rows it was given."""
    rows_at, index_at, weights_at = call

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden, top_k_index, top_k_weights = (_arg(args, kwargs, k) for k in call)
        shape = hidden.shape
        hidden = hidden.reshape(-1, shape[-1])
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = torch.arange(tokens, device=flat.device).repeat_interleave(k)[order]
        counts = routing_counts(flat, groups.num_experts)

        def compute(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
            ids = torch.repeat_interleave(torch.arange(len(per_expert), device=rows.device),
                                          torch.tensor(per_expert, device=rows.device),
                                          output_size=sum(per_expert))[:, None]
            a, kw = _with(args, kwargs, rows_at, rows)
            a, kw = _with(a, kw, index_at, ids)
            a, kw = _with(a, kw, weights_at, torch.ones(ids.shape, dtype=rows.dtype, device=rows.device))
            # the width, not -1: a rank may receive no rows at all (every token routed elsewhere)
            y = original(self, *a, **kw).reshape(rows.shape[0], shape[-1])
            return _touch(y, list(self.parameters()))

        y = exchange(hidden[token_of], counts, groups, compute)
        # each token's k results back in (token, k) order by a gather with the inverse permutation,
        # weighted and summed over k: what the model's own code saves for backward (index_add's
        # backward would keep its weighted source, rows x width, alive for the shape alone)
        y = y[torch.argsort(order)].reshape(tokens, k, hidden.shape[-1])
        y = (y * top_k_weights.reshape(tokens, k, 1).to(y.dtype)).sum(1)
        return y.to(hidden.dtype).reshape(shape)
    return forward


# ---------------------------------------------------------------- a ModuleList of experts


class _RemoteExpert(nn.Module):
    """The place of an expert another ep rank holds (no parameters)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index


class _Replay:
    """Record / replay of one MoE module's expert calls (see the module docstring)."""

    def __init__(self, moe: nn.Module, experts: nn.ModuleList, groups: ExpertGroups) -> None:
        self.groups, self.experts, self.mode = groups, experts, ""
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.results: deque[tuple[int, torch.Tensor]] = deque()
        self.original = type(moe).forward.__get__(moe)

    def slot(self, index: int) -> Callable:
        def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if args or kwargs:
                raise AutoparError("expert parallelism needs experts called with one tensor of rows")
            if self.mode == "record":
                self.calls.append((index, x))
                return torch.zeros_like(x)
            if self.mode == "replay":
                if not self.results or self.results[0][0] != index or self.results[0][1].shape[0] != x.shape[0]:
                    raise AutoparError("the MoE module called its experts differently on replay; expert "
                                       "parallelism needs a deterministic router (no jitter in training)")
                return self.results.popleft()[1]
            raise AutoparError("an expert was called outside its MoE module; expert parallelism cannot follow that")
        return call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.mode, self.calls = "record", []
        try:
            self.original(*args, **kwargs)
        finally:
            self.mode = ""
        order = sorted(range(len(self.calls)), key=lambda i: self.calls[i][0])  # stable: by expert
        counts = torch.zeros(self.groups.num_experts, dtype=torch.int64)
        for i in order:
            counts[self.calls[i][0]] += self.calls[i][1].shape[0]
        if order:
            rows = torch.cat([self.calls[i][1] for i in order])
        else:  # no expert called here: this rank still takes part in its ep group's exchange,
            # with no rows that still hang off the input, so its backward takes part too
            x = next(a for a in args if isinstance(a, torch.Tensor))
            rows = x.reshape(-1, x.shape[-1])[:0]
        # through __call__ of the expert list: FSDP2's hooks gather its shard (ZeRO >= 1)
        y = exchange(rows, counts.to(rows.device), self.groups, self.experts)
        outs = dict(zip(order, torch.split(y, [self.calls[i][1].shape[0] for i in order])))
        self.results = deque((self.calls[i][0], outs[i]) for i in range(len(self.calls)))
        self.mode, self.calls = "replay", []
        try:
            result = self.original(*args, **kwargs)
        finally:
            self.mode = ""
        if self.results:
            self.results.clear()
            raise AutoparError("the MoE module called fewer experts on replay; expert parallelism needs a "
                               "deterministic router (no jitter in training)")
        return result


def _local_list_forward(self: nn.ModuleList, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
    """The local experts on their rows (grouped by local expert, ``per_expert`` rows each)."""
    local = [m for m in self if not isinstance(m, _RemoteExpert)]
    outs, unused = [], []
    for m, chunk in zip(local, torch.split(rows, per_expert)):
        if chunk.shape[0]:
            outs.append(type(m).forward(m, chunk))
        else:
            unused.extend(m.parameters())
    y = torch.cat(outs) if outs else rows.new_zeros((0, rows.shape[-1]))
    return _touch(y, unused)


class ExpertParallelList(nn.ModuleList):
    """An experts ``nn.ModuleList`` under expert parallelism: the same entries (another rank's
    experts are ``_RemoteExpert`` places), callable on rows grouped by local expert."""

    forward = _local_list_forward


def _shard_list(moe: nn.Module, experts: nn.ModuleList, groups: ExpertGroups) -> None:
    local = groups.local_experts
    for e in range(len(experts)):
        if e not in local:
            experts[e] = _RemoteExpert(e)
    replay = _Replay(moe, experts, groups)
    for e, m in enumerate(experts):
        m.forward = replay.slot(e)  # the MoE module's own call of expert e goes to the record/replay
    experts.__class__ = ExpertParallelList
    moe.forward = replay.forward


# ---------------------------------------------------------------- applying it


@dataclass(kw_only=True)
class ExpertParallel:
    """What ``apply_expert_parallel`` did to one rank's part, for the later executor steps."""

    groups: ExpertGroups
    experts: list[nn.Module]  # every block's (sharded) experts module
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # stacked param name -> the full rows it holds
    names: list[str] = field(default_factory=list)  # full-model names of the expert parameters
    fsdp: bool = False  # True: FSDP2 reduces the expert gradients (ZeRO >= 1)
    # sequence parallelism: each MoE unit's other modules run on the sequence shard (the router, an
    # unsharded shared expert: spec/sp_check.shard_local_modules), data-parallel over moe_dp
    shard_local: list[nn.Module] = field(default_factory=list)

    def expert_params(self) -> list[nn.Parameter]:
        return [p for m in self.experts for p in m.parameters()]


def apply_expert_parallel(parts: list[nn.Module], spec: Any, groups: ExpertGroups, prefix: str = "") -> ExpertParallel:
    """Shard the experts of every unit of ``parts`` that holds them (``ModelSpec.moe_units``: every
    block of a block list, a chain's MoE units; this rank's model, or its pipeline chunks, in which
    the model sits under ``prefix``; on meta, before materialising, after TP) and route their tokens
    over the ep group. A unit another pipeline stage runs is absent from a chunk or stands in there
    (its children are no modules): it is skipped. At ep = 1 (sequence parallelism without expert
    parallelism) nothing is sharded or routed: the state names the experts and the shard-local
    modules, whose gradients ``wrap_experts`` reduces over the tp ranks too."""
    state = ExpertParallel(groups=groups, experts=[])
    for part in parts:
        _apply_to_part(part, spec, state, prefix)
    return state


def _shard_local(unit: nn.Module, spec: Any, unit_path: str) -> list[nn.Module]:
    """The unit's modules that run on the sequence shard under SP, the experts apart."""
    from autopar.spec.sp_check import shard_local_modules

    owner = spec.moe.experts_path.rpartition(".")[0]
    styles = spec.unit_tp(spec.unit_paths.index(unit_path)).styles
    found = shard_local_modules(unit, styles, owner)
    if isinstance(found, str):  # preflight's sp check said so already (spec/sp_check.py)
        raise AutoparError(f"{unit_path}: {found}")
    return [unit.get_submodule(n) for n in found if n not in spec.moe.paths]


def _apply_to_part(part: nn.Module, spec: Any, state: ExpertParallel, prefix: str) -> None:
    moe, groups = spec.moe, state.groups
    owner_path = moe.experts_path.rpartition(".")[0]
    for unit_path in spec.moe_units:
        try:
            unit = part.get_submodule(prefix + unit_path)
            held = [unit.get_submodule(p) for p in moe.paths]
        except AttributeError:
            continue  # on another pipeline stage
        if groups.pool_mesh is not None:
            state.shard_local.extend(_shard_local(unit, spec, unit_path))
        if groups.ep == 1:
            state.experts.extend(held)
            continue
        for path, experts in zip(moe.paths, held):
            base = f"{unit_path}.{path}."
            if moe.grouped:
                shard_grouped(experts, groups, base, state.rows, moe.grouped[moe.paths.index(path)])
            elif moe.experts_kind == "stacked":
                keep_local_experts(experts, groups, base, state.rows,
                                   lambda original: _stacked_forward(groups, original, moe.call))
            else:
                _shard_list(unit.get_submodule(owner_path) if owner_path else unit, experts, groups)
            state.experts.append(experts)
            state.names.extend(base + n for n, _ in experts.named_parameters())


def wrap_experts(state: ExpertParallel, part: nn.Module, *, zero: int, dtype: str, dp_cp: int,
                 replicated: bool = False, offload_policy: Any = None) -> None:
    """Before the data-parallel wrap of ``part``: ZeRO >= 1 shards each experts module over its
    edp ranks with FSDP2 (the outer ``fully_shard`` calls then leave them alone), gradients divided
    by dp*cp; ZeRO 0 tells DDP to skip them (``install_grad_sync`` reduces them), or, where the
    part's ZeRO-0 wrap is FSDP2's ``replicate`` rather than DDP (``replicated``: a pipeline stage,
    whose gradient sync the pipelining stage drives after the step's backwards, or DTensor
    parameters at tp > 1), replicates each experts module over its edp ranks the same way (DDP's
    ignore list means nothing to ``replicate``, which would average the experts over dp x cp)."""
    folded = state.groups.pool_mesh is not None  # SP: the tp ranks hold other tokens, never DDP's
    if zero >= 2 or (zero == 1 and dp_cp > 1) or replicated or folded:
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from autopar.torch_dtypes import TORCH_DTYPES

        mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[dtype], reduce_dtype=torch.float32) \
            if dtype != "fp32" else MixedPrecisionPolicy()
        # ZeRO 1 on one data-parallel rank (the part runs unwrapped) shards nothing either
        shard = zero >= 2 or (zero == 1 and dp_cp > 1)
        meshes = [(m, state.groups.edp_mesh) for m in state.experts]
        meshes += [(m, state.groups.pool_mesh) for m in state.shard_local]
        extra = {"offload_policy": offload_policy} if offload_policy is not None else {}  # host offload
        for m, mesh in meshes:
            if not shard:
                replicate(m, mesh=mesh, mp_policy=mp)
            else:
                fully_shard(m, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=mp,
                            shard_placement_fn=_even_shard(mesh.size()), **extra)
            m.set_gradient_divide_factor(float(state.groups.grad_divide))
            group = mesh.get_group()
            if shard and group.size() > 1 and dist.get_backend(group) == "gloo":
                # gloo has no PREMUL_SUM for the reduce-scatter: sum, then divide (a 1-rank group
                # reduces nothing). Not for replicate: it all-reduces with SUM after dividing once,
                # and torch 2.13's forced sum divides a replicated gradient by the factor twice
                m.set_force_sum_reduction_for_comms(True)
        state.fsdp = True
        return
    experts = {id(p) for p in state.expert_params()}
    ignore = [n for n, p in part.named_parameters() if id(p) in experts]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(part, ignore)


def _even_shard(ranks: int) -> Callable[[nn.Parameter], Any]:
    """FSDP2's ``shard_placement_fn`` for expert parameters over ``ranks``: its default Shard(0)
    splits the stacked experts' first dimension, the E / ep experts a rank holds -- one expert of
    Mixtral's 8 at ep 8, which 4 edp ranks cannot split: the first rank kept the whole expert and
    its optimizer states, the others nothing (rehearsed 113 GiB where 74 were priced). Where the
    first dimension does not divide evenly, the largest dimension that does is sharded."""
    from torch.distributed.tensor import Shard

    def place(p: nn.Parameter) -> Any:
        if p.dim() == 0 or p.shape[0] % ranks == 0:
            return None  # FSDP2's default, Shard(0)
        even = [d for d in range(p.dim()) if p.shape[d] % ranks == 0]
        return Shard(max(even, key=lambda d: p.shape[d])) if even else None
    return place


def install_grad_sync(state: ExpertParallel, ddp: nn.Module) -> None:
    """ZeRO 0: at the end of every backward in which DDP syncs (the last micro-batch of a step),
    each expert gradient becomes the sum over its edp ranks divided by dp*cp -- DDP's own moment,
    so whoever reads the gradients after backward (the training loop's ``on_grads``, the
    optimizer) sees them final."""
    if state.fsdp:
        return
    params, groups = state.expert_params(), state.groups
    queued = [False]

    def finish() -> None:
        queued[0] = False
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if groups.edp > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=groups.edp_mesh.get_group())
            for p, g in zip(params, torch.split(flat, [p.numel() for p in params])):
                p.grad.copy_(g.view_as(p.grad))
        for p in params:
            p.grad.div_(groups.grad_divide)

    def on_grad(_p: torch.Tensor) -> None:
        if queued[0] or not getattr(ddp, "require_backward_grad_sync", True):
            return  # inside DDP's no_sync (not the step's last micro-batch), or already queued
        queued[0] = True
        torch.autograd.Variable._execution_engine.queue_callback(finish)  # as DDP queues its own

    for p in params:
        p.register_post_accumulate_grad_hook(on_grad)


def gather_full(state: ExpertParallel, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``local`` (name -> full-over-edp CPU tensor, this rank's experts) completed with the other ep
    ranks' experts: stacked rows concatenated in expert order, listed experts by name. Collective
    over the ep group."""
    mine = {n: t for n, t in local.items() if n in set(state.names)}
    everyone: list[Any] = [None] * state.groups.ep
    dist.all_gather_object(everyone, mine, group=state.groups.ep_group)
    out = dict(local)
    for name in mine:
        if name in state.rows:
            out[name] = torch.cat([d[name] for d in everyone])
    for d in everyone:
        for name, t in d.items():
            if name not in state.rows:
                out[name] = t
    return out
