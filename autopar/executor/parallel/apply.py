"""The ONE place that fixes the order in which a plan is applied to a model.

Order (each step sees the result of the previous one):

1. build the user's model on the **meta** device (no memory);
2. **pipeline split** (outside everything): this rank's chunk(s) of the plan's stage ranges;
3. inside each chunk: **TP (+SP)** with DTensor -> **CP** (attention core replaced) ->
   **recompute** (checkpointed forwards);
4. **materialise**: ``to_empty`` on the device, then every parameter is filled from a full model
   built on CPU from the seed (``torch.manual_seed(seed); build_model()``), sliced to this rank's
   TP shard. The weights are therefore exactly the single-process model's for the same seed, for
   any plan. The full model is built once per node and mapped by its ranks (host_reference.py).
   Done before step 5 because DDP
   broadcasts whatever real tensors it is given; under ZeRO / FSDP2 each block is filled inside
   step 5, right before it is sharded, so no rank holds its whole part unsharded on the device;
5. **ZeRO / FSDP2 / DDP** over the dp x cp mesh;
6. pipeline stages + schedule over the wrapped chunks; optimizer over all local parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.executor.parallel import chain_pipeline as chain_pipe
from autopar.executor.parallel import hf_attention
from autopar.executor.parallel import pipeline_parallel as pipe
from autopar.executor.parallel.buffer_dtypes import built_dtypes, cast_buffers
from autopar.executor.parallel.context_parallel import ContextParallelAttention, apply_cp, position_kwargs
from autopar.executor.parallel.data_parallel import (
    MIXED_PRECISION_KINDS,
    DataParallelResult,
    apply_data_parallel,
    build_optimizer,
    uses_fsdp,
    wrap_kind,
)
from autopar.executor.parallel.host_reference import host_copies, reference_tensors
from autopar.executor.parallel.mesh import ParallelMesh
from autopar.executor.parallel.recompute import apply_recompute
from autopar.executor.parallel.tensor_parallel import apply_tp, fused_row_permutations, keep_grad_placements
from autopar.executor.runtime.checks import check_host_build, host_available_bytes
from autopar.executor.runtime.introspect import ModelSpec
from autopar.modelfile import ModelFile
from autopar.plan import Plan
from autopar.spec.unused import parameters_without_grad
from autopar.torch_dtypes import TORCH_DTYPES


def original_name(name: str, part: nn.Module) -> str:
    """Full-model name of the parameter or buffer ``name`` of ``part`` (one of ``Executable.parts``,
    or a chunk before wrapping). Exactly the prefixes the executor's wrappers put there are removed,
    and only where ``part`` is such a wrapper: DDP's ``module.``, then the pipeline StageModule's
    attribute (``pipeline_parallel.STAGE_PREFIX``). A user's network under an attribute named
    ``model`` or ``module`` keeps its names. FSDP2, ``replicate``, recompute and CP rename nothing."""
    if isinstance(part, nn.parallel.DistributedDataParallel):
        name, part = name.removeprefix("module."), part.module
    if isinstance(part, (pipe.StageModule, chain_pipe.ChainStage)):
        name = name.removeprefix(pipe.STAGE_PREFIX)
    return name


def named_full(part: nn.Module, *, buffers: bool = False, remove_duplicate: bool = True) -> list[tuple[str, Any]]:
    """``part``'s parameters (or buffers) by full-model name (see ``original_name``)."""
    items = part.named_buffers() if buffers else part.named_parameters(remove_duplicate=remove_duplicate)
    return [(original_name(n, part), t) for n, t in items]


@dataclass(kw_only=True)
class Executable:
    """Everything the training loop needs; built by ``build_executable`` on every rank."""

    plan: Plan
    spec: ModelSpec
    mesh: ParallelMesh
    parts: list[nn.Module]  # wrapped (DDP / FSDP / plain) local chunks; one when pp == 1
    dp: list[DataParallelResult]
    optimizer: torch.optim.Optimizer
    permutations: dict[str, torch.Tensor]
    schedule: Any = None  # torch.distributed.pipelining schedule when pp > 1
    stages: list[Any] = field(default_factory=list)
    chunk_ids: list[int] = field(default_factory=list)
    tied: list[tuple[list[str], dist.ProcessGroup | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pipe_io: Any = None  # pp > 1: pipeline_parallel.StepIO (the step's inputs for every stage)
    stage_loss: Any = None  # pp > 1 and tp > 1: the last stage's VocabParallelLoss (its fallback note)
    # full-model parameter name -> canonical name of its tie group (first alias in the full model's
    # named_parameters order); the checkpoint keys of tied weights (checkpoint.py)
    canonical_names: dict[str, str] = field(default_factory=dict)
    expert: Any = None  # expert parallelism: expert_parallel.ExpertParallel of this rank's part when ep > 1

    def parameter_copies(self) -> dict[str, list[nn.Parameter]]:
        """Full-model name -> every local parameter of that name (one per pipeline chunk)."""
        out: dict[str, list[nn.Parameter]] = {}
        for part in self.parts:
            for name, p in named_full(part, remove_duplicate=False):
                out.setdefault(name, []).append(p)
        return out

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """Local parameters by original full-model name (deduplicated)."""
        out: dict[str, nn.Parameter] = {}
        for part in self.parts:
            for name, p in named_full(part):
                out.setdefault(name, p)
        return out


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(param, DTensor):
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(shard)
        else:
            param.copy_(full)


def materialise(part: nn.Module, reference: Mapping[str, torch.Tensor] | None, device: torch.device,
                perms: dict[str, torch.Tensor],
                *, within: nn.Module | None = None, outside: Sequence[nn.Module] = ()) -> None:
    """Allocate ``part`` on ``device`` and copy the seed-initialised ``reference`` values in
    (``host_reference.reference_tensors``: the full model's tensors by name).

    ``to_empty`` gives every module its own new Parameter (meta and real tensors cannot share a
    storage swap), which would silently untie shared weights (GPT's embedding = output head), so
    the ties are recorded first and restored after. ``reference`` None: storage only, no values.

    ``within`` (a submodule): that subtree only; ``outside`` (submodules): every module of
    ``part`` but those subtrees. ZeRO / FSDP2 shards a block right after it is filled, so a rank
    never holds more than one unsharded block (``sharded_fill``)."""
    if within is not None:
        mods = list(within.modules())
    else:
        skip = {id(m) for sub in outside for m in sub.modules()}
        mods = [m for m in part.modules() if id(m) not in skip]
    owners = {id(m) for m in mods}
    in_scope = _in_scope(part, owners)
    aliases: dict[int, list[str]] = {}
    for name, p in part.named_parameters(remove_duplicate=False):
        if in_scope(name):
            aliases.setdefault(id(p), []).append(name)
    for m in mods:
        m.to_empty(device=device, recurse=False)
    for names in aliases.values():
        keep = part.get_parameter(names[0])
        for other in names[1:]:
            owner, _, leaf = other.rpartition(".")
            setattr(part.get_submodule(owner) if owner else part, leaf, keep)
    if reference is None:  # storage only (a rehearsal on fake tensors)
        return
    for name, t in list(part.named_parameters()) + list(part.named_buffers()):
        if not in_scope(name):
            continue
        key = original_name(name, part)
        full = reference[key]
        if key in perms:
            full = full[perms[key]]
        _copy_into(t, full.to(device))


def _in_scope(part: nn.Module, owners: set[int]) -> Callable[[str], bool]:
    """Whether the parameter or buffer ``name`` of ``part`` belongs to a module in ``owners``."""
    def test(name: str) -> bool:
        owner = name.rpartition(".")[0]
        return id(part.get_submodule(owner) if owner else part) in owners
    return test


def sharded_fill(part: nn.Module, blocks: Sequence[nn.Module], reference: Mapping[str, torch.Tensor] | None,
                 device: torch.device, perms: dict[str, torch.Tensor]) -> Callable[[nn.Module], None] | None:
    """For ZeRO / FSDP2: a function that fills one block (or, given ``part``, everything outside
    the blocks) just before ``fully_shard`` shards it, so the device never holds the whole
    unsharded part (torchtitan shards on meta first; here each block is filled from the seed-built
    model at full size, then sharded). None where a parameter is shared across that split (a tie
    between two blocks or a block and the rest): the part is then filled whole, as before."""
    seen: dict[int, int] = {}
    for scope, mod in enumerate([*blocks, None]):
        if mod is None:
            skip = {id(p) for b in blocks for p in b.parameters()}
            params = [p for _, p in part.named_parameters(remove_duplicate=False) if id(p) not in skip]
        else:
            params = [p for _, p in mod.named_parameters(remove_duplicate=False)]
        for p in params:
            if seen.setdefault(id(p), scope) != scope:
                return None

    def fill(module: nn.Module) -> None:
        if module is part:
            materialise(part, reference, device, perms, outside=blocks)
        else:
            materialise(part, reference, device, perms, within=module)
    return fill


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name of the full ``model`` -> the first name of its tie group."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


@dataclass(kw_only=True)
class Shaped:
    """Steps 1-3 of the module docstring done: this rank's chunks of the meta model with TP (+SP),
    CP, recompute and expert parallelism applied. Nothing has storage yet."""

    model: nn.Module  # the full meta model (parameter names, tie groups)
    parts: list[nn.Module]
    chunk_ids: list[int]
    all_chunk_names: list[set[str]]
    perms: dict[str, torch.Tensor]
    canonical: dict[str, str]
    notes: list[str]
    io: Any = None  # pp > 1: pipeline_parallel.StepIO (None for chain chunks)
    probe: Any = None  # pp > 1: pipeline_parallel.Probe (None for chain chunks)
    expert: Any = None  # expert_parallel.ExpertParallel of this rank's part when ep > 1
    # pp > 1, kept only on request: chunk 0 shaped like this rank's chunks (same tp / cp coordinates),
    # whose forward gives the activation that travels between stages (a rehearsal's stage shapes)
    first_chunk: nn.Module | None = None
    # pp > 1 chain chunks, kept only on request (keep_first_chunk): each chunk's unit range and every
    # unit's first argument (chain_pipeline.probe_unit_inputs), the activations between stages
    chain_ranges: list[tuple[int, int]] | None = None
    chain_inputs: dict[str, Any] | None = None


def build_executable(
    plan: Plan, mf: ModelFile, spec: ModelSpec, mesh: ParallelMesh, *, seed: int, lr: float,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Executable:
    """Apply ``plan`` to the model of ``mf`` on this rank (collective: every rank must call it)."""
    return place(shape_parts(plan, mf, spec, mesh), plan, mf, spec, mesh, seed=seed, lr=lr, loss_fn=loss_fn)


def shape_parts(plan: Plan, mf: ModelFile, spec: ModelSpec, mesh: ParallelMesh, *,
                keep_first_chunk: bool = False) -> Shaped:
    """Steps 1-3: build on meta, cut this rank's pipeline chunks, apply TP (+SP), CP, recompute
    and expert parallelism inside each. ``keep_first_chunk``: also shape chunk 0 when it is not
    this rank's (``Shaped.first_chunk``)."""
    par, notes = plan.parallel, []
    model = mf.build("meta")  # 1. meta
    perms = fused_row_permutations(model, spec, par.tp)
    shaped = Shaped(model=model, parts=[model], chunk_ids=[0], all_chunk_names=[], perms=perms,
                    canonical=canonical_names(model), notes=notes)

    # 2. pipeline split (outside)
    extra: list[nn.Module] = []
    if par.pp > 1:
        meta_inputs = mf.example_inputs(plan.training.micro_batch_size, "meta")
        if par.cp > 1:  # stages see this cp rank's share of the sequence
            meta_inputs = meta_inputs[:, : plan.training.seq_len // par.cp]
        ranges = plan.stage_ranges()
        if chain_pipe.uses_chain_chunks(spec):  # a layer chain / Sequential blocks: cut at unit inputs
            n = len(ranges)
            shapes = chain_pipe.probe_chain_shapes(model, spec, meta_inputs)
            chunks = [chain_pipe.build_chain_chunk(model, spec, shapes, rng, is_first=c == 0, is_last=c == n - 1,
                                                   meta_inputs=meta_inputs) for c, rng in enumerate(ranges)]
            if keep_first_chunk:  # a rehearsal: the activations its stages exchange (_chain_stage_shapes)
                shaped.chain_ranges = list(ranges)
                shaped.chain_inputs = chain_pipe.probe_unit_inputs(model, spec, meta_inputs)
        else:
            shaped.probe = pipe.probe_structure(model, spec, meta_inputs)
            shaped.io = pipe.StepIO(meta_inputs, shaped.probe.output)
            chunks = [pipe.build_chunk(model, spec, shaped.probe, rng, index=c, num_chunks=len(ranges), io=shaped.io,
                                       device=mesh.device)
                      for c, rng in enumerate(ranges)]
        if par.cp > 1:
            from autopar.executor.parallel.context_parallel import shard_indices

            positions = shard_indices(plan.training.seq_len, par.cp, mesh.coords.cp).to(mesh.device)
            for ch in chunks:
                ch.call_kwargs = position_kwargs(spec.accepts_positions, positions)
        shaped.all_chunk_names = [{k for k, _ in named_full(ch, remove_duplicate=False)} for ch in chunks]
        shaped.chunk_ids = pipe.local_chunk_ids(plan, mesh.coords.pp)
        shaped.parts = [chunks[c] for c in shaped.chunk_ids]
        if keep_first_chunk and 0 not in shaped.chunk_ids:
            shaped.first_chunk = chunks[0]
            extra = [chunks[0]]
        del chunks

    # 3. inside each chunk: TP(+SP) -> CP -> recompute
    for part in shaped.parts + extra:
        _shape_part(part, plan, spec, mesh, notes)

    # 3b. expert parallelism: this rank's experts (on meta), tokens routed over the ep group; under
    # SP a mixture of experts runs on the sequence shard and reduces its gradients over tp too
    if par.ep > 1 or (par.layout.folds_tp and spec.moe_units):
        from autopar.executor.parallel import expert_parallel as ep_mod

        prefix = pipe.STAGE_PREFIX if par.pp > 1 else ""
        shaped.expert = ep_mod.apply_expert_parallel(shaped.parts, spec, ep_mod.expert_groups(plan, spec, mesh.device),
                                                     prefix)
    return shaped


def _shape_part(part: nn.Module, plan: Plan, spec: ModelSpec, mesh: ParallelMesh, notes: list[str]) -> None:
    """Step 3 on one chunk: TP (+SP), then CP (the attention core replaced), then recompute."""
    par = plan.parallel
    prefix = pipe.STAGE_PREFIX if par.pp > 1 else ""
    if par.tp > 1:
        sub_spec = spec if not prefix else _prefixed(spec, prefix)
        for note in apply_tp(part, sub_spec, mesh.tp, sequence_parallel=par.sequence_parallel):
            if note not in notes:
                notes.append(note)
    recompute = par.recompute
    block_modes = plan.block_recompute() if par.recompute_blocks is not None else None  # per-stage recompute
    selective = recompute == "selective" if block_modes is None else "selective" in block_modes
    if spec.core_name is None and spec.hf_attention is not None and (par.cp > 1 or selective):
        # transformers attention: a registered implementation does CP and/or selective recompute
        make_cp = (lambda: ContextParallelAttention(par.cp_kind, mesh.cp_group, par.cp, mesh.coords.cp,
                                                    plan.training.seq_len)) if par.cp > 1 else None
        keys = None if block_modes is None else {str(b) for b, m in enumerate(block_modes) if m == "selective"}
        hf_attention.install(part, prefix + spec.blocks_path, spec.hf_attention.module,
                             recompute=selective, make_cp=make_cp, recompute_keys=keys)
        recompute = "none" if recompute == "selective" else recompute
        if block_modes is not None:
            block_modes = tuple("none" if m == "selective" else m for m in block_modes)
    elif par.cp > 1:
        assert spec.core_name is not None
        apply_cp(part, prefix + spec.blocks_path, spec.core_name, kind=par.cp_kind, group=mesh.cp_group,
                 cp=par.cp, rank=mesh.coords.cp, seq_len=plan.training.seq_len)
    apply_recompute(part, _prefixed(spec, prefix), recompute, block_modes)
    if par.offload.activations:  # host offload: saved activations of each block on the host
        from autopar.executor.parallel.offload import offload_block_activations

        offload_block_activations(_blocks_of(part, spec, prefix), mesh.device)


def place(
    shaped: Shaped, plan: Plan, mf: ModelFile, spec: ModelSpec, mesh: ParallelMesh, *, seed: int, lr: float,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, fake: bool = False,
) -> Executable:
    """Steps 4-6: storage for the shaped parts, data parallelism, the pipeline schedule and the
    optimizer (collective).

    ``fake`` (autopar.rehearse, under a ``FakeTensorMode`` over a fake process group): storage
    from ``to_empty`` only, no values copied from a seed-built model; DDP's reducer, which is C++
    and needs real storage, is stood in for by a module holding its bucket memory
    (``data_parallel.DDPBuckets``); pipeline stages are given their activation shapes from one
    forward of chunk 0 (a fake group cannot answer the schedule's shape exchange)."""
    par, device, zero = plan.parallel, mesh.device, plan.parallel.zero
    parts, expert, prefix = shaped.parts, shaped.expert, pipe.STAGE_PREFIX if par.pp > 1 else ""

    # 4. materialise from the seed-built full model (fake: storage only). ZeRO / FSDP2 parts are
    # filled block by block inside step 5, each just before it is sharded (``sharded_fill``); a
    # rehearsal and expert parallelism (whose experts are wrapped before the blocks) fill whole.
    if not fake:
        check_host_build(shaped.model, host_copies(), host_available_bytes())
    reference = None if fake else reference_tensors(mf, seed)
    perms = {**shaped.perms, **(expert.rows if expert else {})}
    fills: list[Callable[[nn.Module], None] | None] = []
    for part in parts:
        fill = None
        if not fake and expert is None and uses_fsdp(zero, par.dp * par.cp):
            fill = sharded_fill(part, _blocks_of(part, spec, prefix), reference, device, perms)
        if fill is None:
            materialise(part, reference, device, perms)
        fills.append(fill)
    stage_shapes = None
    if fake and par.pp > 1:  # a rehearsal's fake ranks answer no shape exchange: fixed up front
        stage_shapes = (_stage_shapes(shaped, plan, mf, device) if shaped.io is not None
                        else _chain_stage_shapes(shaped, plan, mf, spec, device))
    if expert is not None:  # experts reduce over their edp ranks, not dp x cp
        from autopar.executor.parallel import expert_parallel as ep_mod

        policy = None
        if par.offload.params:  # host offload (ep 1 under SP): the MoE layers' own FSDP2 units too
            from autopar.executor.parallel.offload import cpu_offload_policy

            policy = cpu_offload_policy(device)
        ep_mod.wrap_experts(expert, parts[0], zero=zero, dtype=plan.training.dtype, dp_cp=par.dp * par.cp,
                            replicated=par.pp > 1 or par.tp > 1,  # ZeRO 0 wraps with replicate there, not DDP
                            offload_policy=policy)

    # 5. ZeRO / FSDP2 / DDP over dp x cp
    dp_mesh = mesh.dp_cp
    wrapped: list[DataParallelResult] = []
    # DDP waits for every parameter's gradient: tell it when some get none (spec/unused.py)
    unused = not fake and wrap_kind(zero, dp_mesh.size(), replicated=par.pp > 1 or par.tp > 1) == "ddp"
    if unused and not spec.routed:  # routed: DDP finds them every step anyway (apply_data_parallel)
        try:
            unused = bool(parameters_without_grad(mf, plan.training.micro_batch_size))
        except Exception:  # noqa: BLE001 - the meta pass cannot tell: let DDP find them each step (slower, right)
            unused = True
    for part, fill in zip(parts, fills):
        blocks = _blocks_of(part, spec, prefix)
        policy = None
        if par.offload.params:  # host offload: FSDP2 CPU offload of params, grads (and so the optimizer)
            from autopar.executor.parallel.offload import cpu_offload_policy

            policy = cpu_offload_policy(device)
        wrapped.append(apply_data_parallel(part, blocks, dp_mesh, zero=zero, dtype=plan.training.dtype, device=device,
                                           pipelined=par.pp > 1 or par.tp > 1, offload_policy=policy,
                                           ddp_stand_in=fake, fill=fill,
                                           host_masters=par.offload.optimizer and not par.offload.params,
                                           unused_params=unused, routed=spec.routed and not fake))
    del reference
    if plan.training.dtype != "fp32" and any(w.kind in MIXED_PRECISION_KINDS for w in wrapped):
        # FSDP2's 16-bit parameters beside the model's buffers: each in the dtype its code gives it
        # when built in the training dtype (executor/parallel/buffer_dtypes.py)
        dtypes = built_dtypes(mf, TORCH_DTYPES[plan.training.dtype])
        for w in wrapped:
            if w.kind in MIXED_PRECISION_KINDS:
                cast_buffers(w.module, dtypes, lambda name, part=w.module: original_name(name, part))

    # 6. pipeline schedule, optimizer, tied-weight groups
    exe = Executable(
        plan=plan, spec=spec, mesh=mesh, parts=[w.module for w in wrapped], dp=wrapped,
        optimizer=None,  # type: ignore[arg-type]  # set below, needs the wrapped parameters
        permutations=shaped.perms, chunk_ids=shaped.chunk_ids, notes=shaped.notes,
        canonical_names=shaped.canonical, expert=expert,
    )
    # every distinct local parameter: an interleaved rank holds a copy of a shared one per chunk
    params = list({id(p): p for part in exe.parts for p in part.parameters()}.values())
    if par.tp > 1:  # embedding gradients come back Replicate; keep them vocab-sharded (tensor_parallel.py)
        keep_grad_placements([p for w in wrapped if w.kind in ("none", "ddp") for p in w.module.parameters()])
    if par.offload.optimizer and not par.offload.params:  # host offload: states on the host, the step on the CPU
        from autopar.executor.parallel.offload import build_host_optimizer

        exe.optimizer = build_host_optimizer(
            params, lambda masters: build_optimizer(masters, plan.training.optimizer, lr, False, None), device)
    else:
        exe.optimizer = build_optimizer(params, plan.training.optimizer, lr,
                                        any(w.sharded_optimizer for w in wrapped), dp_mesh)
    if expert is not None:  # ZeRO 0: expert gradients summed over edp after the step's backward
        ep_mod.install_grad_sync(expert, wrapped[0].module)
    if par.pp > 1:
        _attach_schedule(exe, shaped, plan, mesh, loss_fn, stage_shapes)
    return exe


def _attach_schedule(exe: Executable, shaped: Shaped, plan: Plan, mesh: ParallelMesh, loss_fn: Any,
                     stage_shapes: Any) -> None:
    """The pipeline schedule over the wrapped chunks, the last stage's loss and the tied groups."""
    par, device = plan.parallel, mesh.device
    assert loss_fn is not None, "the pipeline's last stage computes the loss"
    row_target = True  # the model file's loss_fn gets each micro-batch's own inputs (StepIO.loss)
    if par.cp > 1:  # targets arrive pre-shifted and sharded (train.py); see context_parallel.py
        from autopar.executor.parallel.context_parallel import cp_next_token_loss, logits_of

        n_targets = plan.training.micro_batch_size * (plan.training.seq_len - 1)
        loss_fn = lambda out, tgt: cp_next_token_loss(logits_of(out)[0], tgt, n_targets, par.cp)  # noqa: E731
        row_target = False
    if par.tp > 1:  # vocab-sharded logits on the last stage: the same fallback as train.py's loss
        from autopar.executor.parallel.tensor_parallel import VocabParallelLoss

        exe.stage_loss = VocabParallelLoss(loss_fn)
        loss_fn = exe.stage_loss
    if shaped.io is None:  # chain chunks (chain_pipeline.py): the first stage takes the batch, the last the target
        exe.schedule, exe.stages = pipe.build_schedule(plan, exe.parts, shaped.chunk_ids, mesh.pp_group, device,
                                                       loss_fn, stage_shapes=stage_shapes)
        exe.tied = pipe.tied_groups(shaped.model, plan, shaped.all_chunk_names)
        return
    exe.pipe_io = shaped.io
    shaped.io.rows_unreadable = stage_shapes is not None  # a rehearsal (place(fake=True))
    exe.schedule, exe.stages = pipe.build_schedule(plan, exe.parts, shaped.chunk_ids, mesh.pp_group, device,
                                                   shaped.io.loss(loss_fn, row_target=row_target),
                                                   stage_shapes=stage_shapes)
    model, probe = shaped.model, shaped.probe
    shared = tuple(f"{m}.{n}" for m in probe.shared for n, _ in model.get_submodule(m).named_parameters())
    exe.tied = pipe.tied_groups(model, plan, shaped.all_chunk_names, bare=tuple(probe.bare) + shared)


def _stage_shapes(shaped: Shaped, plan: Plan, mf: ModelFile, device: torch.device) -> list[Any]:
    """Per local chunk, (inputs, outputs) as example tensors: what the schedule's shape exchange
    would find (fake ranks; see ``place``). The activation between stages is what chunk 0 hands
    on (every block returns the hidden state's shape); a chunk's outputs are its own forward on it."""
    par = plan.parallel
    first = shaped.parts[shaped.chunk_ids.index(0)] if 0 in shaped.chunk_ids else shaped.first_chunk
    assert first is not None, "shape_parts(keep_first_chunk=True) keeps chunk 0 for a rehearsal"
    if 0 not in shaped.chunk_ids:
        materialise(first, None, device, shaped.perms)
    batch = mf.example_inputs(plan.training.micro_batch_size, "cpu")
    if par.cp > 1:
        batch = batch[:, : plan.training.seq_len // par.cp]
    kwargs = shaped.io.step_kwargs(batch)
    with torch.no_grad(), _shape_autocast(plan, device, shaped.parts + [first]):
        handed = first(**kwargs)
    # the hidden state, and the carried prologue outputs after it (pipeline_probe.Probe.carried)
    handed = tuple(handed) if isinstance(handed, (tuple, list)) else (handed,)
    dtype = _handed_dtype(plan)
    if dtype is not None:
        handed = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in handed)
    handed = tuple(map(_differentiable, handed))  # what a stage receives has a gradient to send back
    hidden = handed if len(handed) > 1 else handed[0]
    out = []
    for c, part in zip(shaped.chunk_ids, shaped.parts):
        inputs = () if c == 0 else handed
        if c == par.num_stage_chunks - 1:
            outputs = _model_outputs(part, plan, device, shaped.parts + [first], *inputs, **shaped.io.step_kwargs(batch))
        else:
            outputs = hidden
        out.append((inputs, outputs))
    return out


def _handed_dtype(plan: Plan) -> torch.dtype | None:
    """The dtype a wrapped stage hands on its activations in, where it differs from a forward run
    here: chunk 0 runs here on fp32 parameters, before FSDP2 (or replicate) wraps it; wrapped, it
    computes in its param_dtype and hands on the training dtype (the receive buffers torch
    pipelining keeps per micro-batch are of that dtype). None: autocast on an unwrapped part (one
    data-parallel rank) keeps the residual stream in fp32, as a run here finds it."""
    par = plan.parallel
    if wrap_kind(par.zero, par.dp * par.cp, replicated=True) in MIXED_PRECISION_KINDS:  # a stage: never DDP
        return TORCH_DTYPES[plan.training.dtype]
    return None


def _model_outputs(part: nn.Module, plan: Plan, device: torch.device, parts: list[nn.Module],
                   *args: Any, **kwargs: Any) -> Any:
    """The last chunk's forward on example inputs: the model's outputs, as differentiable as in a run."""
    with torch.no_grad(), _shape_autocast(plan, device, parts):
        outputs = part(*args, **kwargs)
    return tuple(map(_differentiable, outputs)) if isinstance(outputs, (tuple, list)) else _differentiable(outputs)


def _chain_stage_shapes(shaped: Shaped, plan: Plan, mf: ModelFile, spec: ModelSpec,
                        device: torch.device) -> list[Any] | None:
    """``_stage_shapes`` for chain chunks (chain_pipeline.py): chunk 0 takes one micro-batch of the
    batch; a later chunk the first argument of its first unit, and a chunk hands on the first
    argument of the unit after its last (``Shaped.chain_inputs``), in the dtype a wrapped stage
    computes in; the last chunk's outputs are its own forward. None where the batch is not one
    tensor (the schedule then infers the shapes)."""
    if shaped.chain_inputs is None or shaped.chain_ranges is None or spec.chain is None:
        return None
    batch = mf.example_inputs(plan.training.micro_batch_size, "cpu")
    if not isinstance(batch, torch.Tensor):
        return None
    units, dtype = spec.chain.units, _handed_dtype(plan)

    def activation(unit: int) -> torch.Tensor:
        shape, found = shaped.chain_inputs[units[unit]]
        cast = dtype if dtype is not None and found.is_floating_point else found
        return _differentiable(torch.empty(shape, dtype=cast, device=device))

    last = len(shaped.chain_ranges) - 1
    out = []
    for c, part in zip(shaped.chunk_ids, shaped.parts):
        start, end = shaped.chain_ranges[c]
        inputs = (batch,) if c == 0 else (activation(start),)
        outputs = _model_outputs(part, plan, device, shaped.parts, *inputs) if c == last else activation(end)
        out.append((inputs, outputs))
    return out


def _shape_autocast(plan: Plan, device: torch.device, parts: list[nn.Module]) -> Any:
    """The training dtype's autocast (grouped GEMMs included: runtime/grouped_autocast.py) around a
    forward run only for its shapes: stacked experts' grouped GEMMs take no fp32 operands on a GPU
    or on fake tensors, and a stage's parameters are fp32 until FSDP2 wraps it. Shapes do not
    depend on it; the residual stream stays fp32 under autocast, as without it."""
    from contextlib import nullcontext

    from autopar.executor.runtime.grouped_autocast import holds_stacked_weights, with_grouped_autocast

    if plan.training.dtype == "fp32":
        return nullcontext()
    dtype = TORCH_DTYPES[plan.training.dtype]
    return with_grouped_autocast(torch.autocast(device.type, dtype=dtype), device.type, dtype,
                                 holds_stacked_weights([p for p in parts if p is not None]))


def _differentiable(t: Any) -> Any:
    """``t`` detached and requiring grad, where it is a floating-point tensor (else as it is)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().requires_grad_(True)
    return t


def _blocks_of(part: nn.Module, spec: ModelSpec, prefix: str) -> list[nn.Module]:
    """The repeated blocks (or chain units) of ``part``: what FSDP2 shards one by one."""
    if chain_pipe.uses_chain_chunks(spec):
        return chain_pipe.unit_modules(part, spec, prefix)
    return [m for k, m in part.get_submodule(prefix + spec.blocks_path).named_children() if k.isdigit()]


def _prefixed(spec: ModelSpec, prefix: str) -> ModelSpec:
    import dataclasses

    if not prefix:
        return spec
    return dataclasses.replace(
        spec, blocks_path=prefix + spec.blocks_path,
        vocab_embedding=None if spec.vocab_embedding is None else prefix + spec.vocab_embedding,
        vocab_head=None if spec.vocab_head is None else prefix + spec.vocab_head,
    )


def full_parameters(exe: Executable, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """This rank's parameters (or their gradients) as full, unsharded, un-permuted CPU tensors,
    by original name, tied aliases included. Collective over each parameter's mesh (all ranks of a
    pipeline stage must call it). Missing gradients come back as zeros.
    """
    from autopar.executor.parallel.full_value import full_tensor

    out: dict[str, torch.Tensor] = {}
    local = {n: p for part in exe.parts for n, p in named_full(part, remove_duplicate=False)}
    for name, p in local.items():
        t = p
        if grads:
            t = p.grad if p.grad is not None else torch.zeros_like(p)
        t = full_tensor(t).detach().float().cpu()  # a host shard (FSDP2's CPU offload) gathered on the device
        if name in exe.permutations:
            t = t[torch.argsort(exe.permutations[name])]
        out[name] = t
    if exe.expert is not None and exe.expert.groups.ep > 1:  # expert parallelism: the other ep ranks' experts
        from autopar.executor.parallel.expert_parallel import gather_full

        out = gather_full(exe.expert, out)
    return out
