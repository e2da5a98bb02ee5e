"""Tensor parallelism for Hugging Face's ``Conv1D`` (GPT-2, GPT, ...): a Linear with its weight transposed.

``Conv1D(nf, nx)`` holds ``weight`` of shape (nx, nf) = (in, out) and computes
``addmm(bias, x.view(-1, nx), weight)``. DTensor's ``ColwiseParallel`` / ``RowwiseParallel`` only take
nn.Linear and nn.Embedding, and would shard the wrong weight dim anyway, so:

* ``Conv1DColwise``: weight sharded on dim 1 (its output features) and bias on dim 0; input
  replicated, output sharded on the last dim;
* ``Conv1DRowwise``: weight sharded on dim 0 (its input features), bias replicated -- DTensor's addmm
  adds it once to the partial sums --, output all-reduced (or reduce-scattered over the sequence
  with SP, ``output_layouts=Shard(1)``).

A fused colwise Conv1D (GPT-2's ``c_attn``: q, k, v stacked on the output dim) must give rank r its
slice of each part, [q_r, k_r, v_r], not contiguous columns (rank 0 would hold all of q). The nn.Linear
path permutes the rows of such a weight before sharding (tensor_parallel.fused_row_permutations); for
Conv1D the same layout is DTensor's strided shard, ``_StridedShard(dim, split_factor=k)``: the dim is
seen as k parts and each is sharded over the ranks -- the placement FSDP2 uses for TP-then-FSDP weights.
Parameters stay in the model's own order, so materialising, full-tensor gathers and checkpoints
need no permutation.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard


def is_conv1d(mod: nn.Module) -> bool:
    """HF's ``Conv1D`` (matched by name: transformers is optional)."""
    return type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None and mod.weight.dim() == 2


def _split(dim: int, fused: int) -> Placement:
    return Shard(dim) if fused == 1 else _StridedShard(dim, split_factor=fused)


def _distribute(module: nn.Module, device_mesh: DeviceMesh, src_data_rank: int | None,
                placement_of: Callable[[str], Placement]) -> None:
    """Replace each of ``module``'s own parameters by a DTensor of its placement (by name)."""
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(
            distribute_tensor(param, device_mesh, [placement_of(pname)], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """Column-parallel Conv1D; ``fused``: the number of projections stacked on its output dim."""

    def __init__(self, *, fused: int = 1, **kwargs) -> None:  # noqa: ANN003 - ColwiseParallel's keywords
        if fused < 1:
            raise ValueError(f"Conv1DColwise(fused={fused}): must be >= 1")
        super().__init__(output_layouts=kwargs.pop("output_layouts", None) or _split(-1, fused), **kwargs)
        self.fused = fused

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute(module, device_mesh, self.src_data_rank,
                    lambda pname: _split(1 if pname == "weight" else 0, self.fused))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """Row-parallel Conv1D (weight dim 0 sharded, bias replicated and added once)."""

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute(module, device_mesh, self.src_data_rank,
                    lambda pname: Shard(0) if pname == "weight" else Replicate())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # the partial sums need the input's feature shard
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def conv1d_layout(block: nn.Module, tp_plan: Mapping[str, str], fused: Mapping[str, int], *,
                  sequence_parallel: bool) -> dict[str, Any]:
    """The ParallelStyle of every Conv1D entry of ``tp_plan`` in ``block`` (the nn.Linear entries are
    tensor_parallel.apply_tp's); ``fused``: colwise name -> stacked projections."""
    out: dict[str, Any] = {}
    for name, style in tp_plan.items():
        if not is_conv1d(block.get_submodule(name)):
            continue
        if style == "colwise":
            out[name] = Conv1DColwise(fused=fused.get(name, 1))
        else:
            out[name] = Conv1DRowwise(output_layouts=Shard(1)) if sequence_parallel else Conv1DRowwise()
    return out
