"""Pipeline parallelism: cut the model into stage chunks and run them with
``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B``), with the plan's (possibly uneven) block ranges.

How a user's model is cut without changing its code
---------------------------------------------------
A meta-device probe (``spec.pipeline_probe.probe_structure``) records which modules beside the block list run before the
first block (the *prologue*: embeddings, rotary tables) and after the last (the *epilogue*: final
norm, head), the structure of what each prologue module and a block return, the name of a block's
first forward parameter, and in which phase the model's own code reads each bare parameter (one
registered on the root or an ancestor of the block list: a ViT's class token). Every chunk is a
deep copy of the meta model whose block list holds only the chunk's blocks (under their original
indices, so parameter names match the full model), wrapped in a ``StageModule`` (attribute
``STAGE_ATTR``, the one prefix ``apply.original_name`` removes).

**Every stage runs the model's own forward on the real micro-batch inputs.** The schedule passes
the micro-batch to every stage as keyword arguments (``StepIO.step_kwargs``; the pipelining API
splits keyword arguments into micro-batches like positional ones), so the model's forward computes
its block arguments -- HF's ``position_embeddings=`` (cos, sin), ``attention_mask=``,
``position_ids=`` -- for real on every stage, exactly as on one rank. On a non-first chunk:

* prologue modules holding parameters (embeddings) are replaced by ``_ZeroStub``s returning real
  zeros of the recorded structure, shape and dtype (cheap; their result is discarded), while
  parameter-free ones (rotary tables, dropout) run for real;
* an ``_Inject`` marker just before the chunk's first block returns the activation received from
  the previous stage, in the structure a block returns (a tuple ``(h, None)`` as well as a tensor).
  In an ``nn.ModuleList`` the positions before it hold ``_Skip`` place-holders, so every block runs
  at its own loop position: model code that reads per-layer settings by position
  (``config.layer_types[i]``, Gemma 2's alternating sliding-window masks) sees the right layer;

and on a non-last chunk the epilogue modules are dropped and an ``_Exit`` marker ends the block
list: it raises with the hidden state it is given (positional, or the block's first parameter by
keyword), leaving the model's forward before the epilogue runs. Every marker answers the attribute
reads model code makes on the block or module it replaces (executor/parallel/stand_in.py: ModernBERT reads
``layer.attention_type``, Swin ``stage.downsample``). A parameter-holding prologue module whose
output the epilogue reads (CLIP's first tower, pooled into the loss after the other tower's blocks)
is *carried*: each non-last stage hands its output on after the hidden state, and a ``_Carried``
stand-in returns it on the stages after the first. Activations travel as tuples of
tensors (the pipelining API's contract); the last stage's output -- a tensor, tuple, dict or HF
``ModelOutput`` -- is flattened to its tensors for the API and rebuilt before the model file's
``loss_fn`` sees it (``StepIO.loss``), which also receives the micro-batch's own inputs (dicts with
``labels`` included) whatever the schedule's order: the schedule's target is the micro-batch's row
indices.

Bare parameters (on the root or an ancestor of the block list, or of a sibling module that never
runs as a module) live on the stages whose part of the forward reads them (prologue: the first
chunk; epilogue: the last; between blocks, or feeding a block's keyword arguments: every chunk).
Elsewhere they become non-persistent buffers with the same value (the forward still reads them,
into a result that is discarded), so no stage keeps a meta tensor, and only users hold trainable
copies. A parameter-holding prologue module whose output reaches the blocks other than through the
hidden state (a learned bias passed as ``gain=``), that runs again after the blocks, or whose
parameters the epilogue reads directly (a head computing ``h @ embeddings.weight.T``), is *shared*:
real on every chunk. Every parameter held by several chunks has its gradients summed over all
copies after backward (the local ones of an interleaved rank, then over the pp ranks), like a tied
weight, so the copies take identical optimizer steps.

Tied parameters across stages (GPT's embedding = output head): the first and last stage both hold
the weight; their gradients are summed across those pp ranks after backward (Megatron's
embedding-group all-reduce), so the two copies receive identical Adam updates and stay equal.
Under tp > 1 both copies are sharded by vocabulary (Shard(0), tensor_parallel.py), so a tp rank's
embedding shard and head shard cover the same rows and their local gradients are summed.

Requirements: the blocks are called in order over the block list (a loop or ``nn.Sequential``), and
a block's first input is the hidden state.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.block_dict import BlockDict
from autopar.executor.parallel.batch import rows
from autopar.executor.parallel.stand_in import StandIn
from autopar.executor.runtime.introspect import ModelSpec
from autopar.modelfile import call_model
from autopar.plan import Plan
from autopar.spec.pipeline_probe import Probe, Template, bare_holders, probe_structure, tensors_of

__all__ = ["STAGE_ATTR", "STAGE_PREFIX", "Probe", "StageModule", "StepIO", "Template", "build_chunk",
           "build_schedule", "local_chunk_ids", "probe_structure", "run_schedule", "sync_tied_grads", "tied_groups"]

STAGE_ATTR = "autopar_chunk"  # the StageModule's attribute holding the chunk (a distinctive name)
STAGE_PREFIX = STAGE_ATTR + "."
INPUT_KEY = "autopar_input_"  # keyword arguments carrying the micro-batch's tensors to every stage


# ----------------------------------------------------------------------------------------- markers
class _StageExit(Exception):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("pipeline stage exit")
        self.value = value


def _as_block_output(block_out: Template, hidden: torch.Tensor) -> Any:
    """``hidden`` in the structure a block returns (its other tensor leaves, e.g. attention weights,
    as zeros of their recorded shapes). A block returning a one-element tuple ``(h,)`` gets a tuple:
    model code reads ``layer(h)[0]``, which on a bare tensor would take batch row 0 (HF Falcon-H1)."""
    if block_out.is_tensor == (True,) and block_out.spec.is_leaf():
        return hidden
    shapes = [v for v, t in zip(block_out.leaves, block_out.is_tensor) if t]
    rest = [torch.zeros(v[0], dtype=v[1], device=hidden.device) for v in shapes[1:]]
    return block_out.rebuild([hidden, *rest])


class _Inject(StandIn):
    """First entry of a non-first chunk's block list: returns the received activation in the
    structure a block returns (extra tensor leaves, e.g. attention weights, as zeros)."""

    def __init__(self, block_out: Template) -> None:
        super().__init__()
        self.block_out = block_out
        self.value: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        assert self.value is not None, "StageModule sets the injected activation before the call"
        return _as_block_output(self.block_out, self.value)


class _Skip(StandIn):
    """Holds the place of a block of an earlier chunk in a non-first chunk's block list (see
    ``build_chunk``): passes its hidden-state input on in the structure a block returns. Its value
    is discarded (``_Inject`` replaces it); it exists so that model code reading per-layer settings
    by loop position (``config.layer_types[i]`` in ``for i, layer in enumerate(self.layers)``) sees
    each block at its own position."""

    def __init__(self, block_out: Template, first_param: str | None) -> None:
        super().__init__()
        self.block_out, self.first_param = block_out, first_param

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _as_block_output(self.block_out, args[0] if args else kwargs[self.first_param])


class _Exit(StandIn):
    """Last entry of a non-last chunk's block list: leaves the model's forward with the hidden state
    (the first positional input, or the block's first forward parameter passed by keyword)."""

    def __init__(self, first_param: str | None) -> None:
        super().__init__()
        self.first_param = first_param

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise _StageExit(args[0] if args else kwargs[self.first_param])


class _ChunkIndex:
    """A chunk's container of markers and blocks (the blocks under their original keys), whose integer
    index is the chunk's i-th *block*: code that reads one block for its settings
    (``nn.TransformerEncoder`` reads ``self.layers[0]`` for its fast-path checks) gets a block, not a
    marker or a missing key. Iteration and ``len`` see every child: the model's loop must run the
    markers."""

    _modules: dict[str, nn.Module]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int) and not isinstance(key, bool):
            return [m for k, m in self._modules.items() if k.isdigit()][key]
        return super().__getitem__(key)  # type: ignore[misc]


class _ChunkBlocks(_ChunkIndex, nn.ModuleList):
    """A chunk's block list when the model keeps its blocks in an nn.ModuleList (``_ChunkIndex``)."""


class _ChunkBlockDict(_ChunkIndex, BlockDict):
    """The same for blocks kept in a numbered nn.ModuleDict (torchtitan's ``layers``): the model's loop
    over ``values()`` runs the markers and the chunk's blocks in order."""


class _ZeroStub(StandIn):
    """Stands in for a parameter-holding prologue module on later stages: real zeros of the
    recorded structure (the value is discarded: the received activation replaces it)."""

    def __init__(self, out: Template, device: torch.device) -> None:
        super().__init__()
        self.out, self.device = out, device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.out.zeros(self.device)


class _Carried(StandIn):
    """Stands in, on a later stage, for a prologue module whose output the epilogue reads
    (``Probe.carried``): returns the value the first stage computed, received beside the hidden state."""

    def __init__(self, out: Template) -> None:
        super().__init__()
        self.out = out
        self.value: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        assert self.value is not None, "StageModule sets the carried value before the call"
        return self.value


class _Dropped(StandIn):
    """Stands in for an epilogue module on non-last stages; it is never reached."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("autopar pipeline: an epilogue module ran on a non-last stage")


def _replace(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, leaf = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def _param_to_buffer(root: nn.Module, dotted: str) -> None:
    owner_name, _, leaf = dotted.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    p = owner._parameters.pop(leaf)
    owner.register_buffer(leaf, p.detach(), persistent=False)  # materialise fills its value


# ------------------------------------------------------------------------------------------ stages
class StepIO:
    """One step's inputs as every stage and the last stage's loss see them (module docstring)."""

    def __init__(self, meta_inputs: Any, model_output: Template | None = None) -> None:
        self.inputs = Template.of(meta_inputs)
        self.model_output = model_output  # the probe's: what the whole model returns
        self.output: Template | None = None  # set by the last StageModule when it flattens
        self.batch: Any = None  # this rank's (dp-sliced) batch of the current step
        # a rehearsal on fake tensors (apply.place(fake=True)) cannot read the row indices: the
        # loss takes the first rows of the batch, as many as the micro-batch has (same shapes)
        self.rows_unreadable = False

    def step_kwargs(self, batch: Any) -> dict[str, torch.Tensor]:
        """The keyword arguments of ``schedule.step`` that carry ``batch`` to every stage."""
        return {f"{INPUT_KEY}{i}": t for i, t in enumerate(tensors_of(batch))}

    def micro_batch(self, kwargs: dict[str, Any]) -> Any:
        n = sum(self.inputs.is_tensor)
        return self.inputs.rebuild([kwargs.pop(f"{INPUT_KEY}{i}") for i in range(n)])

    def example_output(self, device: torch.device) -> Any:
        """Zeros in the structure the whole model returns (None: unknown)."""
        return None if self.model_output is None else self.model_output.zeros(device)

    def flatten_output(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return out
        self.output = Template.of(out)
        return tensors_of(out)

    def rebuild_output(self, out: Any) -> Any:
        if self.output is None:
            return out
        return self.output.rebuild(out if isinstance(out, (tuple, list)) else (out,))

    @staticmethod
    def row_target(batch: Any) -> torch.Tensor:
        """The schedule's target: the batch's row indices (split into micro-batches with it). On the
        host: the loss reads each micro-batch's first and last row, and on a GPU reading them off
        the device would synchronize the stream once per micro-batch."""
        return torch.arange(tensors_of(batch)[0].shape[0])

    def loss(self, loss_fn: Callable[[Any, Any], torch.Tensor], *, row_target: bool) -> Callable:
        """The schedule's loss_fn: the model file's ``loss_fn`` on the rebuilt output and, with
        ``row_target``, the micro-batch's own inputs (else the schedule's target as it is)."""
        def fn(output: Any, target: torch.Tensor) -> torch.Tensor:
            if row_target and self.rows_unreadable:
                target = rows(self.batch, 0, target.shape[0])
            elif row_target:
                target = rows(self.batch, int(target[0]), int(target[-1]) + 1)
            return loss_fn(self.rebuild_output(output), target)

        return fn


class StageModule(nn.Module):
    """One pipeline chunk of the user's model: ``forward(*activation, **micro_batch)`` -> the
    activation for the next stage, or the model's (flattened) output on the last stage."""

    def __init__(self, model: nn.Module, *, is_first: bool, is_last: bool, io: StepIO) -> None:
        super().__init__()
        setattr(self, STAGE_ATTR, model)
        self.is_first, self.is_last = is_first, is_last
        self.io = io
        self._inject: _Inject | None = None
        self.call_kwargs: dict[str, Any] = {}  # e.g. positions= of this cp rank's tokens
        # Probe.carried: name -> the stand-in receiving its output here (None on the first stage)
        self._carried: dict[str, _Carried | None] = {}
        self._captured: dict[str, Any] = {}
        # whether torch pipelining is inferring this stage's shapes (build_schedule; see forward)
        self._inferring: Callable[[], bool] = lambda: False

    def carry(self, name: str, stand_in: _Carried | None) -> None:
        """Hand ``name``'s output on to the next stage (received into ``stand_in`` when given)."""
        self._carried[name] = stand_in
        self.chunk.get_submodule(name).register_forward_hook(
            lambda m, a, o, n=name: self._captured.__setitem__(n, o))

    @property
    def chunk(self) -> nn.Module:
        return getattr(self, STAGE_ATTR)

    def forward(self, *args: torch.Tensor, **kwargs: Any) -> Any:
        inputs = self.io.micro_batch(kwargs)
        if not self.is_first and self._inferring():
            # torch pipelining infers a later stage's output shapes by running it once on inputs it
            # allocates uninitialised: an integer tensor carried from the first stage (ViTMAE's
            # restore indices) would index out of bounds (on CUDA a device-side assert). Zeros
            # have its shape and index in range; floating inputs stay as given (they carry the
            # gradient the inference traces back to this stage's inputs)
            args = tuple(torch.zeros_like(t) if isinstance(t, torch.Tensor) and not t.is_floating_point()
                         and not t.is_complex() else t for t in args)
        for t in args:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                # the gradient sent back to the previous stage lands in a buffer laid out as this
                # gradient is (torch's pipelining infers it), and the send needs a dense one: a
                # carried tensor concatenated with the hidden state (Zamba2) gets a strided slice
                t.register_hook(_dense)
        if self._inject is not None:
            self._inject.value = args[0]
            self._receive(args[1:])
        try:
            if self.call_kwargs:
                out = self.chunk(inputs, **self.call_kwargs)
            else:
                out = call_model(self.chunk, inputs)
        except _StageExit as stop:
            # the send to the next stage needs a dense tensor: a block may return a view (a
            # transposed layout, timm-style blocks); contiguous() is free when it already is one
            value = stop.value
            value = value.contiguous() if isinstance(value, torch.Tensor) else value
            if not self._carried:
                return value
            carried = [t.contiguous() for n in self._carried for t in tensors_of(self._captured[n])]
            return (value, *carried)
        finally:
            if self._inject is not None:
                self._inject.value = None
            for stand_in in self._carried.values():
                if stand_in is not None:
                    stand_in.value = None
            self._captured.clear()
        return self.io.flatten_output(out) if self.is_last else out

    def _receive(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Give each carried module's stand-in its value from the tensors after the hidden state
        (only a stage after the first receives, and there every carried module has its stand-in)."""
        at = 0
        for stand_in in self._carried.values():
            assert stand_in is not None, "the first stage receives nothing"
            n = sum(stand_in.out.is_tensor)
            stand_in.value = stand_in.out.rebuild(list(tensors[at:at + n]))
            at += n
        assert at == len(tensors), "the previous stage hands on the hidden state and the carried values"


def build_chunk(
    model: nn.Module, spec: ModelSpec, probe: Probe, block_range: tuple[int, int], *, index: int, num_chunks: int,
    io: StepIO, device: torch.device,
) -> StageModule:
    """A StageModule holding blocks ``[start, end)`` of a deep copy of the meta ``model``."""
    is_first, is_last = index == 0, index == num_chunks - 1
    chunk = copy.deepcopy(model)
    old = chunk.get_submodule(spec.blocks_path)
    blocks = nn.Sequential() if isinstance(old, nn.Sequential) else (
        _ChunkBlockDict() if isinstance(old, BlockDict) else _ChunkBlocks())
    inject = None
    if not is_first:
        if isinstance(blocks, _ChunkIndex):
            # Keep every block at its loop position: HF models pick a block's mask by position
            # (``config.layer_types[i]``: Gemma 2/3, GPT-OSS, Cohere 2), so the marker before this
            # chunk's first block sits at position start - 1, after place-holders for the rest.
            for i in range(block_range[0] - 1):
                skip = _Skip(probe.block_out, probe.block_first_param)
                blocks.add_module(f"skip{i}", skip.stand_for(old[i], f"{spec.blocks_path}.{i}"))
        inject = _Inject(probe.block_out)
        # every marker answers the attribute reads model code makes on the block it stands for
        # (ModernBERT reads ``layer.attention_type`` before calling it): executor/parallel/stand_in.py
        before = block_range[0] - 1
        blocks.add_module("inject", inject.stand_for(old[before], f"{spec.blocks_path}.{before}"))
    for i in range(*block_range):
        blocks.add_module(str(i), old[i])  # original index = original parameter names
    if not is_last:
        after = block_range[1]
        blocks.add_module("exit", _Exit(probe.block_first_param).stand_for(old[after], f"{spec.blocks_path}.{after}"))
    _replace(chunk, spec.blocks_path, blocks)
    carried = {name: None if is_first else _Carried(probe.prologue[name][0]) for name in probe.carried}
    if not is_first:
        for name, (out, holds_params) in probe.prologue.items():
            if holds_params and name not in probe.shared:
                stub = carried.get(name) or _ZeroStub(out, device)
                _replace(chunk, name, stub.stand_for(chunk.get_submodule(name), name))
    if not is_last:
        for name in probe.epilogue:
            _replace(chunk, name, _Dropped().stand_for(chunk.get_submodule(name), name))
    for name, phases in probe.bare.items():
        if not bare_holders(phases, index, num_chunks):
            _param_to_buffer(chunk, name)
    stage = StageModule(chunk, is_first=is_first, is_last=is_last, io=io)
    stage._inject = inject
    for name, stand_in in carried.items():
        stage.carry(name, stand_in)
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
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    stage_shapes: list[tuple[Any, Any]] | None = None,
):
    """PipelineStage per local chunk and the plan's schedule over them. ``stage_shapes``: per local
    chunk, example (inputs, outputs) that fix the stage's activation shapes up front, so the
    schedule exchanges no shapes between ranks (a rehearsal's fake ranks cannot answer it); a
    DTensor among them also fixes its gradient's (the same layout). None: the schedule infers them."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    par = plan.parallel
    n_chunks = par.num_stage_chunks
    if par.zero == 3:  # ZeRO-3's per-micro-batch reduce-scatter and resharding (data_parallel.py)
        from autopar.executor.parallel.data_parallel import sync_every_microbatch

        for mod in stage_modules:
            sync_every_microbatch(mod)
    shapes = stage_shapes or [(None, None)] * len(chunk_ids)
    stages = [
        PipelineStage(mod, stage_index=c, num_stages=n_chunks, device=device, group=pp_group,
                      **_static_args(inputs, outputs))
        for mod, c, (inputs, outputs) in zip(stage_modules, chunk_ids, shapes)
    ]
    for mod, stage, (_, outputs) in zip(stage_modules, stages, shapes):
        if isinstance(mod, StageModule) and outputs is None:
            # shapes inferred at the first step (dynamic mode): until then the stage has no
            # receive buffers, and a forward is torch's inference pass (StageModule.forward)
            mod._inferring = lambda stage=stage: not stage.args_recv_info
    m = plan.num_microbatches
    if par.pp_schedule == "gpipe":
        return ScheduleGPipe(stages[0], n_microbatches=m, loss_fn=loss_fn), stages
    if par.pp_schedule == "1f1b":
        return Schedule1F1B(stages[0], n_microbatches=m, loss_fn=loss_fn), stages
    return ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn), stages


def _static_args(inputs: Any, outputs: Any) -> dict[str, Any]:
    """PipelineStage's static shape arguments for example ``inputs`` / ``outputs`` (None: none)."""
    if outputs is None:
        return {}
    ins, outs = tuple(inputs), tensors_of(outputs) if not isinstance(outputs, torch.Tensor) else (outputs,)
    return {"input_args": ins, "output_args": outs, "input_grads": ins, "output_grads": outs}


def run_schedule(schedule: Any, io: StepIO, batch: Any, *, is_last: bool, target: Any) -> list[torch.Tensor]:
    """One schedule step on this pp rank: every stage gets the micro-batches' inputs (keyword
    arguments); the last gets the loss target (``None``: the row indices, see ``StepIO.loss``).
    Returns the last stage's per-micro-batch losses (empty elsewhere)."""
    io.batch = batch
    kwargs = io.step_kwargs(batch)
    losses: list[torch.Tensor] = []
    try:
        if is_last:
            tgt = io.row_target(batch) if target is None else target
            schedule.step(target=tgt, losses=losses, return_outputs=False, **kwargs)
        else:
            schedule.step(**kwargs)
    finally:
        io.batch = None
    return losses


def _dense(grad: torch.Tensor | None) -> torch.Tensor | None:
    # None: an input no output depends on (torch pipelining's backward shape inference asks for
    # every input's gradient; met by HF CLIP at pp 2 under replicate)
    return None if grad is None else grad.contiguous()


def tied_groups(
    model: nn.Module, plan: Plan, chunk_param_names: list[set[str]], bare: tuple[str, ...] = ()
) -> list[tuple[list[str], dist.ProcessGroup | None]]:
    """For every parameter shared under several names, and every parameter named in ``bare``
    (bare and shared-module parameters), that lands on more than one chunk: its alias names and a
    group of the pp ranks holding it (for this rank's dp/cp/tp coordinate; None where one pp rank
    holds every copy, or this rank none).

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
        if len(names) < 2 and not set(names) & set(bare):
            continue
        chunks = [c for c, have in enumerate(chunk_param_names) if have & set(names)]
        if len(chunks) < 2:
            continue
        holders = sorted({c % par.pp for c in chunks})
        mine = None
        if len(holders) >= 2:
            # Every rank creates every group in the same order (new_group is collective on the world).
            world = dist.get_world_size()
            per_stage = world // par.pp
            for offset in range(per_stage):
                ranks = [h * per_stage + offset for h in holders]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
        out.append((names, mine))
    return out


def sync_tied_grads(
    copies: dict[str, list[nn.Parameter]], groups: list[tuple[list[str], dist.ProcessGroup | None]]
) -> None:
    """Make every copy's gradient the sum over all copies of a tied parameter: the local copies
    (chunks of an interleaved schedule on this rank) and those of the other pp ranks holding one.
    ``copies``: full-model name -> this rank's parameters of that name (one per chunk)."""
    for names, group in groups:
        seen: set[int] = set()
        local = [p for n in names for p in copies.get(n, ()) if not (id(p) in seen or seen.add(id(p)))]
        if not local:
            continue
        for p in local:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        shards = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in local]
        total = shards[0] if len(shards) == 1 else torch.stack(shards).sum(0)
        if group is not None:
            all_reduce_on_group_device(total, group)
        for t in shards:
            if t is not total:
                t.copy_(total)


def all_reduce_on_group_device(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """All-reduce ``t`` in place over ``group`` on a device the group's backend takes: gradients of
    host-offloaded parameters (FSDP2's CPU offload) live on the CPU, which NCCL refuses, so a CUDA
    group reduces a device copy and the sum is copied back."""
    if t.device.type == "cpu" and torch.cuda.is_available() and dist.get_backend(group) == "nccl":
        on_device = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device, group=group)
        t.copy_(on_device)
        return
    dist.all_reduce(t, group=group)
