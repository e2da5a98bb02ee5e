"""On the meta device, a mixture of experts that loops over the experts its routing hit and picks each
one by an id read from a tensor runs every expert once (spec/meta_values.py): by ``operator.index``
into an ``nn.ModuleList``, or by a formatted 0-d tensor into an ``nn.ModuleDict`` (HF Switch
Transformers' ``experts[f"expert_{idx[0]}"]``, which raised KeyError on the tensor's repr)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.spec.meta import tolerant_meta

D, E, TOKENS = 8, 4, 16


class SwitchMoE(nn.Module):
    """Top-1 routing by argmax, a one-hot dispatch mask, experts in a ModuleDict or a ModuleList."""

    def __init__(self, keyed: bool) -> None:
        super().__init__()
        self.keyed = keyed
        self.router = nn.Linear(D, E)
        experts = [nn.Linear(D, D) for _ in range(E)]
        self.experts = nn.ModuleDict({f"expert_{i}": m for i, m in enumerate(experts)}) if keyed else nn.ModuleList(experts)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.functional.one_hot(self.router(x).argmax(dim=-1), num_classes=E)  # (tokens, E)
        out = torch.zeros_like(x)
        hit = torch.greater(mask.sum(dim=0), 0).nonzero()  # (experts hit, 1)
        for idx in hit:
            expert = self.experts[f"expert_{idx[0]}"] if self.keyed else self.experts[idx]
            self.seen.append(list(self.experts.values() if self.keyed else self.experts).index(expert))
            rows = torch.where(mask[:, idx[0]])[0]
            out.index_add_(0, rows, expert(x[rows]))
        return out


@pytest.mark.parametrize("keyed", [True, False], ids=["module-dict-by-formatted-id", "module-list-by-index"])
def test_each_hit_expert_runs_once_on_meta(keyed: bool) -> None:
    with torch.device("meta"):
        moe = SwitchMoE(keyed)
        x = torch.empty(TOKENS, D)
    with tolerant_meta():
        y = moe(x)
    assert y.shape == (TOKENS, D) and y.is_meta
    assert sorted(moe.seen) == list(range(E))  # each expert once (before: expert 0, E times / KeyError)


def test_formatting_a_plain_meta_scalar_reads_zero_and_the_patch_is_undone() -> None:
    t = torch.empty((), dtype=torch.int64, device="meta")
    with tolerant_meta():
        assert f"{t}" == "0"
    assert "meta" in f"{t}"  # outside the block: torch's own formatting


class CountedExperts(nn.Module):
    """JetMoE / ScatterMoE-style routing: a float one-hot made by scattering 1 at the top-k indices,
    summed into per-expert counts read with ``.tolist()`` and used as split sizes of the sorted rows."""

    def __init__(self, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(D, E, bias=False)
        self.weight = nn.Parameter(torch.empty(E, D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, idx = self.router(x).float().topk(self.top_k, dim=1)
        gates = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device).scatter(1, idx, 1)
        sizes = gates.long().sum(0).tolist()
        _, order = idx.flatten().sort(0)
        rows = x[order.div(self.top_k, rounding_mode="trunc")]
        outs = [nn.functional.linear(part, self.weight[e]) for e, part in enumerate(rows.split(sizes, dim=0))]
        return torch.cat(outs, dim=0)


def test_a_float_one_hot_scattered_at_the_routing_counts_tokens_per_expert() -> None:
    with torch.device("meta"):
        moe = CountedExperts()
        x = torch.empty(TOKENS, D)
    with tolerant_meta():
        y = moe(x)  # before: split sizes [0, 0, 0, 0] (the float mask was not a routing tensor)
    assert y.shape == (TOKENS * 2, D)


def test_a_max_over_values_without_a_learned_weight_behind_them_is_no_router() -> None:
    # LongT5's transient-global attention takes torch.max over block ids built from the attention
    # mask: taken for a top-1 router over the sequence, it made the ep reason name experts
    ids = torch.ones(2, 64, device="meta").cumsum(1)
    with tolerant_meta() as mode:
        torch.max(ids, dim=-1)
    assert mode.routing is None
    with torch.device("meta"):
        moe = SwitchMoE(keyed=False)
        x = torch.empty(TOKENS, D)
    with tolerant_meta() as mode:
        moe(x)
    assert mode.routing is not None and mode.routing.num_experts == E  # a router's scores carry a gradient


class GatedMax(nn.Module):
    """xLSTM's stabiliser: the max of learned gates over a chunk, its indices never read."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(x).max(-1).values[:, None]


def test_a_max_whose_indices_nothing_reads_is_no_router() -> None:
    with torch.device("meta"):
        model, x = GatedMax(), torch.empty(TOKENS, D)
    with tolerant_meta() as mode:
        model(x)
    assert mode.routing is None  # learned scores, but no expert is picked by the indices
    with torch.device("meta"):
        moe = SwitchMoE(keyed=False)
    with tolerant_meta() as mode:
        model(x)  # an unread max first: the router after it still routes
        moe(x)
    assert mode.routing is not None and (mode.routing.top_k, mode.routing.num_experts) == (1, E)
