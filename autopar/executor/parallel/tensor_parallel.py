"""Tensor parallelism (Megatron) with DTensor ``parallelize_module``, plus Megatron sequence parallelism.

Contract: ``apply_tp(part, spec, tp_mesh, sp, first_block, last_block)`` parallelises every block of
``part`` (blocks found at ``spec.blocks_path``) in place, from the block-relative ``spec.tp_plan``
(a list of differing blocks: each block from the plan of its unit kind, ``spec.unit_tp``; a kind
without a plan stays replicated), and shards the token embedding and the output head by vocabulary (Megatron's vocab-parallel
embedding and head, as torchtitan does it):

* embedding (``spec.vocab_embedding``) -> ``RowwiseParallel(input_layouts=Replicate(),
  output_layouts=Replicate())``: weight Shard(0), each rank looks up the ids in its vocabulary range
  (zeros elsewhere) and the output is all-reduced. With SP the first block's pre-hook then keeps the
  rank's sequence shard (the model's own code may add position embeddings in between, so the
  embedding cannot reduce-scatter straight into the sequence shard);
* head (``spec.vocab_head``) -> ``ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
  use_local_output=False)``: weight Shard(0), each rank computes its vocabulary slice of the logits
  and the model returns them as a DTensor sharded on the vocabulary (torchtitan's loss-parallel
  head). The loss runs vocab-parallel under DTensor's ``loss_parallel()`` (``VocabParallelLoss``,
  entered by the training loop around forward and backward): the model file's ``loss_fn`` gets the
  sharded DTensor, and ``F.cross_entropy`` on it all-reduces per token only the max, the sum of
  exponentials and the target logit -- three all-reduces of b·s values instead of all-gathering
  b·s·V logits, and no full-vocabulary logits in memory (Megatron's vocab-parallel cross-entropy).
  The input gradient of the head is all-reduced in backward. With SP the last block's post-hook
  has already gathered the sequence. Any other op the loss_fn applies to the DTensor keeps
  full-logits semantics (DTensor redistributes as the op needs), so a loss_fn that runs on it gives
  the same loss; one that cannot run on a DTensor at all (it mixes the logits with a plain tensor,
  or uses an op without a sharding rule) makes ``VocabParallelLoss`` fall back, at its first call,
  to all-gathered full logits and a full-vocabulary loss on every rank, with a run note (the cost
  model prices the vocab-parallel loss; the fallback's gather is not in the estimate). Why not keep
  the gather for every loss_fn: it costs an all-gather of the logits per micro-batch and a full
  b·s·V logits tensor (plus its gradient) on every rank, which dominates the edges at large
  vocabularies. With pp > 1 the pipeline schedule calls the same ``VocabParallelLoss`` on the last
  stage's DTensor logits (inside the same ``loss_parallel()``; executor/parallel/apply.py), fallback included;
* a tied embedding/head weight (GPT) is Shard(0) for both, so the one DTensor parameter serves
  both: the head keeps the embedding's sharded parameter (``_SharedColwise`` does not distribute an
  already-distributed parameter again). On pipeline stages the first stage holds it as the
  embedding and the last as the head, the same shard per tp rank, so summing the local gradients
  over those pp ranks (pipeline_parallel.sync_tied_grads) stays correct.
* another ``nn.Embedding`` holding the embedding's weight (BART's encoder and decoder lookups of
  ``model.shared``) gets the same vocab-parallel lookup on that one sharded parameter (``_SharedRowwise``);
  a float buffer over the vocabulary (BART's ``final_logits_bias``, added to the sharded logits) becomes a
  replicated DTensor, which DTensor slices to the logits' shard.
* a vocabulary not divisible by tp keeps the edges replicated (a note says so).
* DTensor has no vocab-sharded strategy for the embedding's backward: with a replicated output
  gradient it computes the weight's gradient Replicate (full vocabulary on every rank), so the
  lookup runs on each rank's own rows (tp_vocab_lookup.py, Megatron's VocabParallelEmbedding).
  Where DTensor's lookup stays (max_norm, scale_grad_by_freq, sparse embeddings) the gradient
  of the Shard(0) parameter is full-size (memory) and its local tensor is not the shard
  (pipeline_parallel.sync_tied_grads would all-reduce mismatched tensors). ``keep_grad_placements``
  hooks re-shard such a gradient as soon as it is accumulated (Replicate -> Shard(0) is a local
  slice, no communication). FSDP2 / replicate parts need no hook: they reduce into the parameter's
  own layout.

* colwise -> ``ColwiseParallel`` (weight Shard(0)); rowwise -> ``RowwiseParallel`` (weight Shard(1),
  output all-reduced, or reduce-scattered over the sequence with SP).
* Fused projections: a colwise Linear whose width is k > 1 times the input width of its rowwise
  partner (GPT's fused ``qkv`` = 3 x proj) holds k stacked projections. Plain Shard(0) would give
  rank 0 all of q and half of k, so its rows are permuted (``fused_row_permutations``) before
  sharding so that rank r holds [q_r; k_r; v_r] -- Megatron's interleaved QKV layout. Adam is
  elementwise, so training the permuted weight is the same as training the original.
* SP (Megatron-SP): the residual stream between blocks is sharded over the sequence (dim 1);
  norms run on the shard (``SequenceParallel``); the input of each attention/MLP sub-block is
  all-gathered (backward: reduce-scatter) and the rowwise output is reduce-scattered. Which norms
  sum their gradient over tp, and which replicated layers take the gathered input whole, follows
  the block's data flow (tp_replicated.py: MLA's q_a_proj and q_a_layernorm compute the full
  gradient on every rank; a per-head q_norm, with or without SP, a partial one). The first
  block's input is split and the last block's output all-gathered, both with DTensor autograd.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._pytree import tree_flatten, tree_map

from autopar.executor.parallel import tp_replicated as replicated
from autopar.executor.parallel import tp_vocab_lookup as vocab_lookup
from autopar.executor.parallel.tp_conv1d import conv1d_layout, is_conv1d
from autopar.executor.runtime.introspect import ModelSpec
from autopar.spec.tp_plan import plan_fused, set_local_attrs
from autopar.spec.tp_shard import vocab_buffers


class _SharedColwise(ColwiseParallel):
    """ColwiseParallel that leaves a parameter already distributed as Shard(0) on the same mesh as
    it is (the tied embedding weight): the same Parameter object, so the tie survives and no second
    copy or second sharding is made."""

    def _partition_linear_fn(self, name, module, device_mesh):  # noqa: ANN001 - torch's signature
        _shard_rows_keeping_tied(module, device_mesh, self.src_data_rank, "head")


class _SharedRowwise(RowwiseParallel):
    """RowwiseParallel for an embedding that holds the token embedding's already-sharded weight (BART's
    encoder and decoder ``embed_tokens``, both tied to ``model.shared``): the same Parameter stays, so
    the tie survives, and the module gets the vocab-parallel lookup its input and output need."""

    def _partition_embedding_fn(self, name, module, device_mesh):  # noqa: ANN001 - torch's signature
        _shard_rows_keeping_tied(module, device_mesh, self.src_data_rank, "embedding")


def _shard_rows_keeping_tied(module: nn.Module, device_mesh: DeviceMesh, src_data_rank: int | None,
                             what: str) -> None:
    """Shard ``module``'s own parameters by rows (Shard(0)); one already distributed so on this mesh
    (a tied edge's weight) stays the same Parameter, anything else distributed is refused."""
    for pname, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            if param.device_mesh != device_mesh or tuple(param.placements) != (Shard(0),):
                raise ValueError(f"tied {what} parameter {pname} is distributed as {param.placements}, not Shard(0)")
            continue
        module.register_parameter(pname, nn.Parameter(
            distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


def _find(part: nn.Module, name: str | None, kind: type) -> nn.Module | None:
    """The submodule ``name`` of ``part`` if it is still a ``kind`` here (a pipeline chunk replaces
    the edges it does not run by stubs)."""
    if name is None:
        return None
    try:
        mod = part.get_submodule(name)
    except AttributeError:
        return None
    return mod if isinstance(mod, kind) else None


def shard_vocab_edges(part: nn.Module, spec: ModelSpec, tp_mesh: DeviceMesh) -> list[str]:
    """Shard this part's token embedding and output head by vocabulary (see module docstring).
    Returns notes for the run log."""
    emb = _find(part, spec.vocab_embedding, nn.Embedding)
    head = _find(part, spec.vocab_head, nn.Linear)
    if emb is None and head is None:
        return []
    tp = tp_mesh.size()
    vocab = emb.num_embeddings if emb is not None else head.out_features
    if vocab % tp:
        return [f"vocabulary {vocab} is not divisible by tp = {tp}: embedding and output head kept replicated"]
    tied = emb is not None and head is not None and head.weight is emb.weight
    sites = _alias_sites(part, [m for m in (emb, head) if m is not None])
    if emb is not None:
        parallelize_module(emb, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        vocab_lookup.install(emb)  # backward on the rank's rows only (tp_vocab_lookup.py)
    if head is not None:
        if tied:
            head.weight = emb.weight  # the embedding's DTensor parameter; _SharedColwise keeps it
        # Logits stay sharded on the vocabulary: the loss runs under loss_parallel (VocabParallelLoss).
        parallelize_module(head, tp_mesh, _SharedColwise(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                         use_local_output=False))
        if tied:
            assert head.weight is emb.weight
    for mod, name, owner, pname in sites:  # other attributes tied to an edge's parameter follow it
        mod.register_parameter(name, getattr(owner, pname))
        if emb is not None and name == "weight" and mod.weight is emb.weight and isinstance(mod, nn.Embedding):
            # another lookup of the same table: it must look up vocab-parallel as the embedding does,
            # or it mixes the sharded weight with the replicated ids
            parallelize_module(mod, tp_mesh, _SharedRowwise(input_layouts=Replicate(), output_layouts=Replicate()))
            vocab_lookup.install(mod)
    if head is not None:
        _vocab_buffers_as_dtensors(part, getattr(spec, "blocks_path", None), vocab, tp_mesh)
    return []


def _vocab_buffers_as_dtensors(part: nn.Module, blocks_path: str | None, vocab: int, tp_mesh: DeviceMesh) -> None:
    """Float buffers over the vocabulary outside the blocks (BART's ``final_logits_bias``, added to the
    logits after the head) become replicated DTensors: the head's logits are a vocab-sharded DTensor,
    and DTensor refuses an op mixing it with a plain tensor; a replicated operand is sliced locally."""
    for mod, name, buf in vocab_buffers(part, blocks_path, vocab):
        if not isinstance(buf, DTensor):
            persistent = name not in mod._non_persistent_buffers_set
            mod.register_buffer(name, distribute_tensor(buf, tp_mesh, [Replicate()]), persistent=persistent)


def _alias_sites(part: nn.Module, edges: list[nn.Module]) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, attribute, edge, edge parameter name) for every other place in ``part`` that holds
    one of the edges' own parameters (HF BERT: ``cls.predictions.bias`` is the decoder's bias).
    Sharding the edge replaces its parameters; these sites must then hold the sharded ones, or the
    tie breaks and the alias keeps a stale, never-trained copy."""
    owners = {id(p): (edge, pname) for edge in edges for pname, p in edge.named_parameters(recurse=False)}
    sites = []
    for mod in part.modules():
        if any(mod is e for e in edges):
            continue
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in owners:
                sites.append((mod, name, *owners[id(p)]))
    return sites


def _holds_dtensor(value: Any) -> bool:
    return any(isinstance(v, DTensor) for v in tree_flatten(value)[0])


def _full(value: Any) -> Any:
    """Every DTensor in ``value`` as its full (all-gathered, differentiable) local tensor."""
    return tree_map(lambda v: v.full_tensor() if isinstance(v, DTensor) else v, value)


class VocabParallelLoss:
    """The model file's ``loss_fn`` on vocabulary-sharded logits (see the module docstring).

    Call it inside ``loss_context(True)``, which must also cover the backward. Returns a plain
    tensor: the loss DTensor (replicated over tp by loss_parallel) as its full value. An output
    without DTensors (edges kept replicated) goes to ``loss_fn`` unchanged. The first call that
    gets a DTensor decides: if ``loss_fn`` raises on it, this and every later call all-gather the
    logits first (the pre-loss_parallel behaviour) and ``note`` says so.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.vocab_parallel: bool | None = None  # None: not decided yet
        self.note: str | None = None

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if not _holds_dtensor(output):
            return self.loss_fn(output, target)
        if self.vocab_parallel is None:
            try:
                loss = _full(self.loss_fn(output, target))
            except Exception as exc:  # noqa: BLE001 - any failure on a DTensor means: gather instead
                self.vocab_parallel = False
                self.note = (f"loss_fn does not run on vocab-sharded logits ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}); logits are all-gathered "
                             "and the full-vocabulary loss runs on every tp rank (the estimate assumes "
                             "a vocab-parallel loss)")
            else:
                self.vocab_parallel = True
                return loss
        if self.vocab_parallel:
            return _full(self.loss_fn(output, target))
        return self.loss_fn(_full(output), target)


def loss_context(tp: int) -> AbstractContextManager:
    """``loss_parallel()`` when tensor parallelism is on (forward and backward of the loss must
    run inside it: its cross-entropy and log-softmax rules replace DTensor's defaults)."""
    return loss_parallel() if tp > 1 else nullcontext()


def _align_grad(p: torch.Tensor) -> None:
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
        p.grad = g.redistribute(p.device_mesh, p.placements)


def keep_grad_placements(params: list[torch.Tensor]) -> int:
    """Make every DTensor parameter's accumulated gradient take the parameter's placements (see the
    module docstring); returns how many hooks were installed. Call on the final parameters
    (materialise replaces the meta ones)."""
    n = 0
    for p in params:
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_post_accumulate_grad_hook(_align_grad)
            n += 1
    return n


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _chunk_permutation(rows: int, k: int, tp: int) -> torch.Tensor:
    """Row order that makes Shard(0) over ``tp`` ranks give each rank its slice of all k chunks."""
    n = rows // k
    per = n // tp
    idx = [c * n + r * per + i for r in range(tp) for c in range(k) for i in range(per)]
    return torch.tensor(idx, dtype=torch.long)


def fused_row_permutations(model: nn.Module, spec: ModelSpec, tp: int) -> dict[str, torch.Tensor]:
    """Full-model parameter name -> row permutation for every fused colwise weight/bias.

    ``full[perm]`` is what gets sharded; ``sharded_full[inverse(perm)]`` restores the original.
    A fused HF Conv1D gets the identity (see below).
    """
    if tp == 1 or not (spec.tp_plan or spec.kind_tp):
        return {}
    blocks = model.get_submodule(spec.blocks_path)
    perms: dict[str, torch.Tensor] = {}
    for i, _ in enumerate(blocks):
        plan = spec.unit_tp(i)  # a chain's units: the plan of each unit's kind
        if not plan.styles:
            continue
        for name, k in plan_fused(blocks[i], plan).items():
            if k == 1:
                continue
            lin = blocks[i].get_submodule(name)
            if is_conv1d(lin):
                # Strided-sharded instead (tp_conv1d.py): its values need no permutation, but its
                # shards are not contiguous chunks, which DCP cannot describe; an identity entry
                # makes the checkpoint save it whole, as it saves the permuted ones.
                for pname, p in lin.named_parameters(recurse=False):
                    perms[f"{spec.blocks_path}.{i}.{name}.{pname}"] = torch.arange(p.shape[0])
                continue
            perm = _chunk_permutation(lin.out_features, k, tp)
            perms[f"{spec.blocks_path}.{i}.{name}.weight"] = perm
            if lin.bias is not None:
                perms[f"{spec.blocks_path}.{i}.{name}.bias"] = perm
    return perms


@functools.lru_cache(maxsize=None)
def _first_param_of(cls: type) -> str | None:
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return named[0].name if named else None


def _first_param_name(module: nn.Module) -> str | None:
    """Name of the first parameter of ``module``'s forward (HF attention: ``hidden_states``); read
    once per class (the hooks run on every call)."""
    return _first_param_of(type(module))


def _map_first_input(module: nn.Module, args: tuple, kwargs: dict, fn: Callable[[Any], Any]) -> tuple[tuple, dict]:
    """(args, kwargs) with ``fn`` applied to the module's first input: the first positional
    argument, or its first forward parameter passed by keyword (HF: ``self_attn(hidden_states=...)``)."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    name = _first_param_name(module)
    if name is None or name not in kwargs:
        raise RuntimeError(f"sequence parallelism: {type(module).__name__} was called without its input "
                           f"({name or 'a positional argument'})")
    return args, {**kwargs, name: fn(kwargs[name])}


def _map_first_output(out: Any, fn: Callable[[Any], Any]) -> Any:
    """``out`` with ``fn`` applied to its hidden state: the tensor, or a tuple's first element."""
    if isinstance(out, tuple) and out:
        return (fn(out[0]), *out[1:])
    return fn(out)


def _gather_sequence_pre_hook(mesh: DeviceMesh):
    """All-gather the module's input over the sequence; backward reduce-scatters (SP)."""

    def gather(x: Any) -> Any:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return x.redistribute(mesh, [Replicate()])

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _map_first_input(module, args, kwargs, gather)

    return hook


def _split_sequence_pre_hook(mesh: DeviceMesh):
    """Keep this tp rank's sequence shard of a replicated input (backward all-gathers)."""

    def split(x: Any) -> Any:
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _map_first_input(module, args, kwargs, split)

    return hook


def _gather_sequence_post_hook(mesh: DeviceMesh):
    def gather(x: Any) -> Any:
        return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        return _map_first_output(out, gather)

    return hook


def _copy_output(module: nn.Module, args: Any, out: Any) -> Any:
    return _map_first_output(out, torch.Tensor.clone)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tp ranks (Megatron's "copy to the
    tensor-parallel region", here for features a replicated layer hands every rank's heads)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()  # summed in place: never the caller's buffer
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _grad_sum_hook(width: int, tp_mesh: DeviceMesh) -> Callable[..., Any]:
    """A forward hook on a replicated layer whose last ``width`` output features reach every tp
    rank's sharded heads directly (TPPlan.grad_sums: multi-head latent attention's shared rotary
    key): their gradient, partial on each rank, is summed over the tp ranks; the other features
    reach the heads through a column-parallel layer, whose input gradient DTensor sums already."""
    group = tp_mesh.get_group()

    def hook(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        kept, shared = out.split([out.shape[-1] - width, width], dim=-1)
        return torch.cat([kept, _SumGradOverTP.apply(shared, group)], dim=-1)
    return hook


def apply_tp(
    part: nn.Module,
    spec: ModelSpec,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
) -> list[str]:
    """Parallelise the blocks of ``part`` in place and shard its vocabulary edges; returns notes.
    Block keys are their global indices (pipeline chunks keep the original keys), which is how the
    first and last block are recognised for SP."""
    assert spec.tp_plan or spec.kind_tp, "preflight guarantees a tp_plan when tp > 1"
    notes = shard_vocab_edges(part, spec, tp_mesh)
    blocks = part.get_submodule(spec.blocks_path)
    for key, block in blocks.named_children():
        if not key.isdigit():
            continue  # pipeline markers, not blocks
        plan = spec.unit_tp(int(key))  # a chain of differing blocks: the plan of this unit's kind
        if not plan.styles:
            continue  # a unit kind without shardable layers runs replicated on every tp rank
        layout: dict[str, Any] = {}
        for name, style in plan.styles.items():
            if style == "colwise":
                layout[name] = ColwiseParallel()
            else:
                layout[name] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        layout.update(conv1d_layout(block, plan.styles, plan_fused(block, plan),
                                    sequence_parallel=sequence_parallel))
        summed = replicated.summed_norms(block, plan, sequence_parallel)
        for name in summed:
            # A plain local shard out, as the rowwise layers' reduce-scatter gives: post-LN blocks
            # (BERT) add a norm's output to a rowwise output.
            layout[name] = SequenceParallel(use_local_output=True)
        parallelize_module(block, tp_mesh, layout)
        if sequence_parallel:
            for name in replicated.whole_modules(block, plan, summed):
                block.get_submodule(name).register_forward_pre_hook(replicated.local_input_pre_hook, with_kwargs=True)
        for name, width in plan.grad_sums.items():
            block.get_submodule(name).register_forward_hook(_grad_sum_hook(width, tp_mesh))
        for name in spec.unit_inplace_outputs(int(key)):
            # after the rowwise output hook: to_local()'s view may not be modified in place (spec/inplace.py)
            block.get_submodule(name).register_forward_hook(_copy_output)
        set_local_attrs(block, plan.local_attrs, tp_mesh.size())  # widths the block's code splits by
        if sequence_parallel:
            parents = {_parent(n) for n, s in plan.styles.items() if s == "colwise"}
            for p in parents:
                block.get_submodule(p).register_forward_pre_hook(_gather_sequence_pre_hook(tp_mesh), with_kwargs=True)
            idx = int(key)
            if idx == 0:
                block.register_forward_pre_hook(_split_sequence_pre_hook(tp_mesh), with_kwargs=True)
            if idx == spec.num_blocks - 1:
                block.register_forward_hook(_gather_sequence_post_hook(tp_mesh))
    return notes
