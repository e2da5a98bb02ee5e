"""Pipeline parallelism: cut the model into stage chunks and run them with
``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B``), with the plan's (possibly uneven) block ranges.

How a user's model is cut without changing its code
---------------------------------------------------
A meta-device probe run records which modules next to the block list run before the first block
(the *prologue*, e.g. embeddings) and after the last (the *epilogue*, e.g. final norm + head).
Every chunk is a deep copy of the meta model whose block ModuleList holds only the chunk's blocks
(registered under their original indices, so parameter names match the full model), and:

* a non-first chunk replaces its prologue modules by stubs that return meta tensors of the recorded
  shape (free), and puts an ``_Inject`` marker first in the block list that returns the activation
  received from the previous stage; it is called with meta example inputs, so the model's own
  forward runs unchanged;
* a non-last chunk drops its epilogue modules and ends the block list with an ``_Exit`` marker that
  raises, returning the activation to ``StageModule.forward`` before the epilogue code runs.

The stage module, not the user's model, is the unit FSDP2/DDP wrap, so no FSDP hook is skipped by
the early exit. Requirements: the blocks are called in a loop over the ModuleList, the prologue and
epilogue are modules returning tensors, and ``example_inputs`` returns one tensor.

Tied parameters across stages (GPT's embedding = output head): the first and last stage both hold
the weight; their gradients are summed across those pp ranks after backward (Megatron's
embedding-group all-reduce), so the two copies receive identical Adam updates and stay equal.
Under tp > 1 both copies are sharded by vocabulary (Shard(0), tensor_parallel.py), so a tp rank's
embedding shard and head shard cover the same rows and their local gradients are summed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.executor.introspect import ModelSpec
from autopar.modelfile import call_model
from autopar.plan import Plan


class _StageExit(Exception):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("pipeline stage exit")
        self.value = value


class _Inject(nn.Module):
    """First entry of a non-first chunk's block list: yields the received activation."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.value is not None, "StageModule sets the injected activation before the call"
        return self.value


class _Exit(nn.Module):
    """Last entry of a non-last chunk's block list: leaves the model's forward with the activation."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise _StageExit(x)


class _MetaStub(nn.Module):
    """Stands in for a prologue module on later stages: returns a meta tensor of the recorded shape."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape, self.dtype = tuple(shape), dtype

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


class _Dropped(nn.Module):
    """Stands in for an epilogue module on non-last stages; it is never reached."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("autopar pipeline: an epilogue module ran on a non-last stage")


@dataclass(frozen=True, kw_only=True)
class Probe:
    """Prologue/epilogue module names (dotted, from the root) and prologue output metas."""

    prologue: dict[str, tuple[torch.Size, torch.dtype]]
    epilogue: tuple[str, ...]


def probe_structure(model: nn.Module, spec: ModelSpec, meta_inputs: Any) -> Probe:
    """Run ``model`` (on meta) once and classify the modules around the block list."""
    path = spec.blocks_path.split(".")
    candidates: dict[str, nn.Module] = {}
    for depth in range(len(path)):
        prefix = ".".join(path[:depth])
        parent = model.get_submodule(prefix) if prefix else model
        for name, child in parent.named_children():
            if name != path[depth]:
                candidates[f"{prefix}.{name}" if prefix else name] = child
    events: list[tuple[str, str, Any]] = []
    handles = []
    for name, mod in candidates.items():
        handles.append(mod.register_forward_hook(lambda m, a, o, n=name: events.append(("mod", n, o))))
    blocks = model.get_submodule(spec.blocks_path)
    handles.append(blocks[0].register_forward_pre_hook(lambda m, a: events.append(("first", "", None))))
    handles.append(blocks[len(blocks) - 1].register_forward_hook(lambda m, a, o: events.append(("last", "", None))))
    try:
        with torch.no_grad():
            call_model(model, meta_inputs)
    finally:
        for h in handles:
            h.remove()
    kinds = [e[0] for e in events]
    first, last = kinds.index("first"), len(kinds) - 1 - kinds[::-1].index("last")
    prologue: dict[str, tuple[torch.Size, torch.dtype]] = {}
    epilogue: list[str] = []
    for i, (kind, name, out) in enumerate(events):
        if kind != "mod":
            continue
        if i < first:
            if not isinstance(out, torch.Tensor):
                raise ValueError(f"pipeline: prologue module {name} returns {type(out).__name__}, not a tensor")
            prologue[name] = (out.shape, out.dtype)
        elif i > last:
            epilogue.append(name)
    return Probe(prologue=prologue, epilogue=tuple(epilogue))


def _replace(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, leaf = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


class StageModule(nn.Module):
    """One pipeline chunk of the user's model; ``forward(x)`` -> activation or model output."""

    def __init__(self, model: nn.Module, *, is_first: bool, is_last: bool, meta_inputs: Any) -> None:
        super().__init__()
        self.model = model
        self.is_first, self.is_last = is_first, is_last
        self._meta_inputs = meta_inputs  # a plain attribute: not a buffer, never materialised
        self._inject: _Inject | None = None
        self.call_kwargs: dict[str, Any] = {}  # e.g. positions= of this cp rank's tokens

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if not self.is_first:
            assert self._inject is not None
            self._inject.value = args[0]
        if self.is_first:
            inputs = args[0] if len(args) == 1 else args
        else:
            inputs = self._meta_inputs  # the prologue runs on meta stubs; _Inject supplies args[0]
        try:
            if self.call_kwargs:
                return self.model(inputs, **self.call_kwargs)
            return call_model(self.model, inputs)
        except _StageExit as stop:
            return stop.value
        finally:
            if self._inject is not None:
                self._inject.value = None


def build_chunk(
    model: nn.Module, spec: ModelSpec, probe: Probe, block_range: tuple[int, int], *, is_first: bool, is_last: bool, meta_inputs: Any
) -> StageModule:
    """A StageModule holding blocks ``[start, end)`` of a deep copy of the meta ``model``."""
    chunk = copy.deepcopy(model)
    old = chunk.get_submodule(spec.blocks_path)
    blocks = nn.ModuleList()
    inject = None
    if not is_first:
        inject = _Inject()
        blocks.add_module("inject", inject)
    for i in range(*block_range):
        blocks.add_module(str(i), old[i])  # original index = original parameter names
    if not is_last:
        blocks.add_module("exit", _Exit())
    _replace(chunk, spec.blocks_path, blocks)
    if not is_first:
        for name, (shape, dtype) in probe.prologue.items():
            _replace(chunk, name, _MetaStub(shape, dtype))
    if not is_last:
        for name in probe.epilogue:
            _replace(chunk, name, _Dropped())
    stage = StageModule(chunk, is_first=is_first, is_last=is_last, meta_inputs=meta_inputs)
    stage._inject = inject
    return stage


def local_chunk_ids(plan: Plan, pp_rank: int) -> list[int]:
    """Chunks on this pp rank: chunk c lives on rank c % pp (torch's interleaved 'loop' layout)."""
    par = plan.parallel
    return [pp_rank + v * par.pp for v in range(par.pp_virtual_stages)]


def build_schedule(
    plan: Plan,
    stage_modules: list[nn.Module],
    chunk_ids: list[int],
    pp_group: dist.ProcessGroup,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """PipelineStage per local chunk and the plan's schedule over them."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    par = plan.parallel
    n_chunks = par.num_stage_chunks
    stages = [
        PipelineStage(mod, stage_index=c, num_stages=n_chunks, device=device, group=pp_group)
        for mod, c in zip(stage_modules, chunk_ids)
    ]
    m = plan.num_microbatches
    if par.pp_schedule == "gpipe":
        return ScheduleGPipe(stages[0], n_microbatches=m, loss_fn=loss_fn), stages
    if par.pp_schedule == "1f1b":
        return Schedule1F1B(stages[0], n_microbatches=m, loss_fn=loss_fn), stages
    return ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn), stages


def tied_groups(
    model: nn.Module, plan: Plan, chunk_param_names: list[set[str]]
) -> list[tuple[list[str], dist.ProcessGroup | None]]:
    """For every parameter shared under several names that lands on more than one pp rank, a group
    of the pp ranks holding it (for this rank's dp/cp/tp coordinate) and the local alias names.

    ``chunk_param_names[c]``: parameter names (original, full-model) present on chunk c.
    Must be called on every rank with the same arguments (new_group is collective). pp is the
    outermost mesh axis, so the rank of (pp h, offset o) is h * (world / pp) + o.
    """
    par = plan.parallel
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    out: list[tuple[list[str], dist.ProcessGroup | None]] = []
    for names in aliases.values():
        if len(names) < 2:
            continue
        holders = sorted({c % par.pp for c, have in enumerate(chunk_param_names) if have & set(names)})
        if len(holders) < 2:
            continue
        # Every rank creates every group in the same order (new_group is collective on the world).
        world = dist.get_world_size()
        per_stage = world // par.pp
        mine = None
        for offset in range(per_stage):
            ranks = [h * per_stage + offset for h in holders]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        out.append((names, mine))
    return out


def sync_tied_grads(
    named_params: dict[str, nn.Parameter], groups: list[tuple[list[str], dist.ProcessGroup | None]]
) -> None:
    """Sum the gradients of tied parameters across the pp ranks that hold a copy."""
    for names, group in groups:
        if group is None:
            continue
        local = [named_params[n] for n in names if n in named_params]
        if not local:
            continue
        grad = local[0].grad
        if grad is None:
            grad = torch.zeros_like(local[0])
            local[0].grad = grad
        t = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(t, group=group)
