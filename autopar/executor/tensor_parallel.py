"""Tensor parallelism (Megatron) with DTensor ``parallelize_module``, plus Megatron sequence parallelism.

Contract: ``apply_tp(part, spec, tp_mesh, sp, first_block, last_block)`` parallelises every block of
``part`` (blocks found at ``spec.blocks_path``) in place, from the block-relative ``spec.tp_plan``.
The embedding and output head stay replicated inside the tp group (their gradients are then equal on
every tp rank, so no extra reduction is needed).

* colwise -> ``ColwiseParallel`` (weight Shard(0)); rowwise -> ``RowwiseParallel`` (weight Shard(1),
  output all-reduced, or reduce-scattered over the sequence with SP).
* Fused projections: a colwise Linear whose width is k > 1 times the input width of its rowwise
  partner (GPT's fused ``qkv`` = 3 x proj) holds k stacked projections. Plain Shard(0) would give
  rank 0 all of q and half of k, so its rows are permuted (``fused_row_permutations``) before
  sharding so that rank r holds [q_r; k_r; v_r] -- Megatron's interleaved QKV layout. Adam is
  elementwise, so training the permuted weight is the same as training the original.
* SP (Megatron-SP): the residual stream between blocks is sharded over the sequence (dim 1);
  norms run on the shard (``SequenceParallel``); the input of each attention/MLP sub-block is
  all-gathered (backward: reduce-scatter) and the rowwise output is reduce-scattered. The first
  block's input is split and the last block's output all-gathered, both with DTensor autograd.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autopar.executor.introspect import ModelSpec


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def fused_factors(block: nn.Module, tp_plan: Mapping[str, str]) -> dict[str, int]:
    """Block-relative colwise name -> number of fused projections it stacks (1 = not fused)."""
    rowwise = [n for n, s in tp_plan.items() if s == "rowwise"]
    out: dict[str, int] = {}
    for name, style in tp_plan.items():
        if style != "colwise":
            continue
        width = block.get_submodule(name).out_features
        partners = [r for r in rowwise if _parent(r) == _parent(name)] or rowwise
        k = 1
        if partners:
            partner_in = block.get_submodule(partners[0]).in_features
            if width > partner_in and width % partner_in == 0:
                k = width // partner_in
        out[name] = k
    return out


def _chunk_permutation(rows: int, k: int, tp: int) -> torch.Tensor:
    """Row order that makes Shard(0) over ``tp`` ranks give each rank its slice of all k chunks."""
    n = rows // k
    per = n // tp
    idx = [c * n + r * per + i for r in range(tp) for c in range(k) for i in range(per)]
    return torch.tensor(idx, dtype=torch.long)


def fused_row_permutations(model: nn.Module, spec: ModelSpec, tp: int) -> dict[str, torch.Tensor]:
    """Full-model parameter name -> row permutation for every fused colwise weight/bias.

    ``full[perm]`` is what gets sharded; ``sharded_full[inverse(perm)]`` restores the original.
    """
    if tp == 1 or not spec.tp_plan:
        return {}
    blocks = model.get_submodule(spec.blocks_path)
    perms: dict[str, torch.Tensor] = {}
    for name, k in fused_factors(blocks[0], spec.tp_plan).items():
        if k == 1:
            continue
        for i, _ in enumerate(blocks):
            lin = blocks[i].get_submodule(name)
            perm = _chunk_permutation(lin.out_features, k, tp)
            perms[f"{spec.blocks_path}.{i}.{name}.weight"] = perm
            if lin.bias is not None:
                perms[f"{spec.blocks_path}.{i}.{name}.bias"] = perm
    return perms


def _gather_sequence_pre_hook(mesh: DeviceMesh):
    """All-gather the first positional input over the sequence; backward reduce-scatters (SP)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return (x.redistribute(mesh, [Replicate()]), *args[1:]), kwargs

    return hook


def _split_sequence_pre_hook(mesh: DeviceMesh):
    """Keep this tp rank's sequence shard of a replicated input (backward all-gathers)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (x.redistribute(mesh, [Shard(1)]).to_local(), *args[1:]), kwargs

    return hook


def _gather_sequence_post_hook(mesh: DeviceMesh):
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        x = DTensor.from_local(out, mesh, [Shard(1)], run_check=False)
        return x.redistribute(mesh, [Replicate()]).to_local()

    return hook


def _is_norm(mod: nn.Module) -> bool:
    return isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or type(mod).__name__.endswith("Norm")


def apply_tp(
    part: nn.Module,
    spec: ModelSpec,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
) -> None:
    """Parallelise the blocks of ``part`` in place. Block keys are their global indices (pipeline
    chunks keep the original keys), which is how the first and last block are recognised for SP."""
    assert spec.tp_plan, "preflight guarantees a tp_plan when tp > 1"
    blocks = part.get_submodule(spec.blocks_path)
    for key, block in blocks.named_children():
        if not key.isdigit():
            continue  # pipeline markers, not blocks
        layout: dict[str, Any] = {}
        for name, style in spec.tp_plan.items():
            if style == "colwise":
                layout[name] = ColwiseParallel()
            else:
                layout[name] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        if sequence_parallel:
            for name, mod in block.named_modules():
                if name and _is_norm(mod):
                    layout[name] = SequenceParallel()
        parallelize_module(block, tp_mesh, layout)
        if sequence_parallel:
            parents = {_parent(n) for n, s in spec.tp_plan.items() if s == "colwise"}
            for p in parents:
                block.get_submodule(p).register_forward_pre_hook(_gather_sequence_pre_hook(tp_mesh), with_kwargs=True)
            idx = int(key)
            if idx == 0:
                block.register_forward_pre_hook(_split_sequence_pre_hook(tp_mesh), with_kwargs=True)
            if idx == spec.num_blocks - 1:
                block.register_forward_hook(_gather_sequence_post_hook(tp_mesh))
