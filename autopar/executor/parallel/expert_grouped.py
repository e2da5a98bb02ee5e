"""Expert parallelism for stacked experts called with their rows already grouped by expert and the
rows per expert (``MoESpec.grouped``; JetMoE's ``ParallelExperts``: ``experts(rows sorted by expert,
counts)``, its MoE module's own code routing, gating and scattering around the call).

The counts are the routing: the rows of expert e are the next counts[e] rows, which is what
``exchange`` takes. Each such stack keeps its own experts' rows of every parameter and its forward
becomes: the grouped rows sent to the ranks holding their experts, the model's own expert code run
there on the rows received (grouped by local expert, with the local counts), the results sent back
in the order of the rows the caller gave. The caller sees the call it made answered as one rank
answers it, so its gates and scatter are unchanged. A mixture of two such stacks (an up and a down
projection with the model's activation between) exchanges twice: the code between them is the
model's and runs on the caller's rank.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from autopar.executor.parallel.expert_exchange import ExpertGroups, _arg, _touch, _with, exchange, keep_local_experts


def _local_counts(counts: Any, per_local: list[int]) -> Any:
    """``per_local`` in the form the caller passed ``counts`` (a list, a tuple or an integer tensor)."""
    if isinstance(counts, torch.Tensor):
        return torch.tensor(per_local, dtype=counts.dtype, device=counts.device)
    return tuple(per_local) if isinstance(counts, tuple) else list(per_local)


def grouped_forward(groups: ExpertGroups, original: Callable, rows_at: str, counts_at: str) -> Callable:
    """The forward of a grouped stack under ep: its call's rows (grouped by expert) and counts (all E
    experts), at the places ``rows_at`` / ``counts_at`` name, exchanged over the ep group, the
    model's own ``original`` forward run on this rank's experts' rows, the results returned in the
    order of the rows given (a 2-D tensor, one result row per row)."""
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows, counts = _arg(args, kwargs, rows_at), _arg(args, kwargs, counts_at)
        sizes = torch.as_tensor(counts, dtype=torch.int64).to(rows.device)  # the exchange's counts, on its device

        def compute(grouped: torch.Tensor, per_local: list[int]) -> torch.Tensor:
            a, kw = _with(args, kwargs, rows_at, grouped)
            a, kw = _with(a, kw, counts_at, _local_counts(counts, per_local))
            return _touch(original(self, *a, **kw), list(self.parameters()))

        return exchange(rows, sizes, groups, compute)
    return forward


def shard_grouped(experts: nn.Module, groups: ExpertGroups, prefix: str, rows: dict[str, torch.Tensor],
                  grouped: tuple[str, str, str]) -> None:
    """Keep this rank's experts of the stack ``experts`` (its entry ``grouped`` of
    ``MoESpec.grouped``: path, rows at, counts at) and route its calls over the ep group."""
    _, rows_at, counts_at = grouped
    keep_local_experts(experts, groups, prefix, rows,
                       lambda original: grouped_forward(groups, original, rows_at, counts_at))
