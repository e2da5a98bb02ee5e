"""Expert parallelism's exchange (executor/parallel/expert_parallel.py): the ep and edp groups of a
rank, the all-to-all of rows sorted by expert to the ranks holding their experts and back, and how a
stacked experts module keeps its own experts' rows and has its calls routed. The routing of each
kind of experts module (called with rows, top-k indices and weights: expert_parallel.py; with rows
grouped by expert and the rows per expert: expert_grouped.py) builds on these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ExpertGroups:
    """The ep and edp groups of this rank, from a DeviceMesh ``[pp, edp, ep, tp]`` (the plan's
    ``[pp, dp, cp, tp]`` with dp x cp refactored as edp x ep, ep innermost: autopar.layout's
    ``EXPERT_DIMS`` and ``Layout.expert_shape``)."""

    mesh: Any  # DeviceMesh with dims pp, edp, ep, tp
    ep: int
    edp: int  # ranks holding the same experts: dp * cp / ep (dp * cp * tp / ep folded)
    num_experts: int
    grad_divide: int  # dp * cp
    # sequence parallelism (autopar.layout's folds_tp): the MoE layers run on the tp ranks' sequence
    # shards, and their replicated parts (router, an unsharded shared expert) are data-parallel over
    # this 1-D mesh of dp x cp x tp ranks (``moe_dp``); None otherwise
    pool_mesh: Any = None

    @property
    def ep_rank(self) -> int:
        return self.mesh["ep"].get_local_rank()

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh["ep"].get_group()

    @property
    def edp_mesh(self) -> Any:
        return self.mesh["edp"]

    @property
    def local_experts(self) -> range:
        per = self.num_experts // self.ep
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of uneven splits with autograd (its backward is the reverse all-to-all)."""
    from torch.distributed import _functional_collectives as fc

    return fc.wait_tensor(fc.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


def _is_fake(t: torch.Tensor) -> bool:
    """No values to read: a fake tensor (``autopar rehearse``) or a meta one."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def routing_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert of the top-k expert ids ``flat``. On fake tensors (``autopar rehearse``:
    no values to count) the balanced split the cost model assumes, the remainder to the first
    experts: the same on every rank, so the exchange's sizes are known without reading a value."""
    if not _is_fake(flat):
        return torch.bincount(flat, minlength=num_experts)
    each, extra = divmod(flat.numel(), num_experts)
    return torch.tensor([each + (e < extra) for e in range(num_experts)], dtype=torch.int64, device=flat.device)


def exchange(rows: torch.Tensor, counts: torch.Tensor, groups: ExpertGroups,
             compute: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    """Send ``rows`` (sorted by expert id; ``counts[e]`` rows for expert e, all E) to the ranks
    owning their experts, run ``compute(rows grouped by local expert, rows per local expert)`` there,
    and return the results in the order of ``rows``. Collective over the ep group. On fake tensors
    (a rehearsal) every rank sends and receives the balanced counts of ``routing_counts``."""
    ep, per, group = groups.ep, groups.num_experts // groups.ep, groups.ep_group
    # Under autocast (fp32 parameters: DDP, pipeline stages at ZeRO 0-1) the rows travel in the
    # autocast dtype, as the cost model prices them: the expert GEMMs would cast them so anyway
    dtype, device_type = rows.dtype, rows.device.type
    if rows.is_floating_point() and torch.is_autocast_enabled(device_type):
        low = torch.get_autocast_dtype(device_type)
        if low.itemsize < dtype.itemsize:
            rows = rows.to(low)
    send_counts = counts.to(torch.int64).reshape(ep, per)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # (source rank, local expert)
    if _is_fake(send_counts):  # a rehearsal: the balanced counts routing_counts gave every rank
        each, extra = divmod(rows.shape[0], groups.num_experts)
        mine = [each + (groups.ep_rank * per + e < extra) for e in range(per)]  # what each source sends here
        send_splits = [sum(each + (r * per + e < extra) for e in range(per)) for r in range(ep)]
        recv_splits, per_local = [sum(mine)] * ep, [n * ep for n in mine]
    else:
        send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        per_local = recv_counts.sum(0).tolist()
    received = _a2a(rows, recv_splits, send_splits, group)
    # received rows come by source rank, each source's by local expert: regroup by local expert
    local_ids = torch.repeat_interleave(torch.arange(per, device=rows.device).repeat(ep),
                                        recv_counts.flatten().to(rows.device), output_size=sum(recv_splits))
    order = torch.argsort(local_ids, stable=True)
    grouped = received[order]
    # + an exact 0 that depends on the received rows: the dispatch's backward (an all-to-all over
    # the ep group) must run on every rank, also where the local experts got no rows and their
    # output does not depend on them (autograd would skip it there and the peers wait forever)
    out_grouped = compute(grouped, per_local) + grouped[:0].sum()
    # back to arrival order by a gather with the inverse permutation: index_copy's backward keeps
    # its source (rows x width) alive for the shape alone, a gather keeps only the indices
    out = out_grouped[torch.argsort(order)] if order.numel() else out_grouped
    return _a2a(out.to(rows.dtype), send_splits, recv_splits, group).to(dtype)


def _touch(y: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
    """``y`` plus a zero that depends on ``params``: every local expert parameter gets a gradient
    (zeros where no token came), so the ranks sharing an expert reduce the same set of tensors."""
    if not params:
        return y
    return y + sum(p.reshape(-1)[0] for p in params) * 0.0


def _with(args: tuple, kwargs: dict, key: str, value: Any) -> tuple[tuple, dict]:
    """``args`` / ``kwargs`` with the argument at ``key`` (a position "0", "1", ... or a keyword) replaced."""
    if key.isdigit():
        i = int(key)
        return args[:i] + (value,) + args[i + 1:], kwargs
    return args, {**kwargs, key: value}


def _arg(args: tuple, kwargs: dict, key: str) -> Any:
    return args[int(key)] if key.isdigit() else kwargs[key]


def keep_local_experts(experts: nn.Module, groups: ExpertGroups, prefix: str, rows: dict[str, torch.Tensor],
                       forward: Callable[[Callable], Callable]) -> None:
    """Keep this rank's rows of every per-expert parameter under ``experts`` (stacked: E leading;
    packed: E x f rows, f per expert; on meta: materialise copies them in), set the expert
    count the model's own expert loop reads (an attribute equal to E whose name says experts) to
    the local experts, and route its calls through ``forward(original forward)``."""
    local, num = groups.local_experts, groups.num_experts
    for name, p in list(experts.named_parameters()):
        owner_path, _, leaf = name.rpartition(".")
        owner = experts.get_submodule(owner_path) if owner_path else experts
        per = p.shape[0] // num  # rows per expert: 1 stacked, f packed
        keep = torch.arange(local.start * per, local.stop * per)
        setattr(owner, leaf, nn.Parameter(torch.empty((keep.numel(),) + tuple(p.shape[1:]), dtype=p.dtype,
                                                      device=p.device), requires_grad=p.requires_grad))
        rows[f"{prefix}{name}"] = keep
    for mod in experts.modules():
        for attr, value in list(vars(mod).items()):
            if "expert" in attr and isinstance(value, int) and not isinstance(value, bool) and value == num:
                setattr(mod, attr, len(local))  # the model's own expert loop runs over the local experts
    cls = type(experts)
    experts.__class__ = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": forward(cls.forward)})
