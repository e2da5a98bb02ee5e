"""Mixture-of-experts facts about a model's block: where the experts are, how many, how many each
token uses, and what they weigh (``MoESpec``; ``ModelSpec.moe``).

Found from the block's structure, whatever the names:

* the experts: an ``nn.ModuleList`` of >= 2 identical modules inside the block (hand-written MoE,
  older Hugging Face code), or a module whose parameters are all stacked per expert (3-D, one
  leading dimension E >= 2: Hugging Face's ``MixtralExperts``, ``Qwen2MoeExperts``);
* the router: the block's module outside the experts whose 2-D weight maps the width to E scores
  (an ``nn.Linear(d, E)``, HF's ``*TopKRouter``);
* top-k: the model config (``num_experts_per_tok`` and its aliases), else a ``top_k`` attribute of
  the MoE modules, else the ``torch.topk`` the router's forward calls (seen on meta). Without a
  router module and without such a call, identical sub-modules are not taken for experts.

The graph counts expert compute at the expected tokens per expert (tokens x top_k / E, balanced
routing; autopar.spec.meta); this object is what expert parallelism and the planner read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from autopar.spec.blocks import is_block_list

# Config names of top-k (not plain ``top_k``: on a model config that is a sampling setting).
_CONFIG_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "num_selected_experts",
                 "router_top_k", "n_activated_experts")
_MODULE_TOP_K = _CONFIG_TOP_K + ("top_k", "k")


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """One block's mixture of experts. Names are block-relative dotted paths."""

    experts_path: str
    experts_kind: str  # "ModuleList" (one module per expert) | "stacked" (3-D parameters, E first)
    num_experts: int
    top_k: int
    top_k_source: str  # "config" | "attribute" | "topk call"
    params_per_expert: int
    router_name: str | None

    def __post_init__(self) -> None:
        if self.experts_kind not in ("ModuleList", "stacked"):
            raise ValueError(f"experts_kind must be ModuleList or stacked, got {self.experts_kind!r}")
        if not (isinstance(self.num_experts, int) and self.num_experts >= 2):
            raise ValueError(f"num_experts must be an integer >= 2, got {self.num_experts!r}")
        if not (isinstance(self.top_k, int) and 1 <= self.top_k <= self.num_experts):
            raise ValueError(f"top_k must be an integer in 1..{self.num_experts}, got {self.top_k!r}")
        if self.params_per_expert < 1:
            raise ValueError(f"params_per_expert must be positive, got {self.params_per_expert}")

    @property
    def expert_params(self) -> int:
        """Parameters of all experts of one block (every rank holds them all without expert parallelism)."""
        return self.num_experts * self.params_per_expert

    @property
    def active_fraction(self) -> float:
        """The share of expert parameters one token uses (top_k / E)."""
        return self.top_k / self.num_experts

    def describe(self) -> str:
        return (f"{self.num_experts} experts at {self.experts_path}, top-{self.top_k} ({self.top_k_source}), "
                f"{self.params_per_expert:,} parameters each, router {self.router_name or 'not found'}")


def _stacked_experts(mod: nn.Module) -> int | None:
    """E when every parameter of ``mod`` (directly owned) is stacked per expert (>= 3-D, or a 2-D
    per-expert bias next to them) with one leading dimension E >= 2."""
    if type(mod).__module__.startswith("torch.nn"):
        return None  # a torch layer (a Conv1d weight is 3-D too), never a stack of experts
    params = list(mod.parameters(recurse=False))
    if not params or not any(p.dim() >= 3 for p in params):
        return None
    leading = {p.shape[0] for p in params if p.dim() >= 2}
    if len(leading) != 1 or any(p.dim() < 2 for p in params):
        return None
    e = leading.pop()
    return e if e >= 2 else None


def _find_experts(block: nn.Module) -> tuple[str, str, int, int] | None:
    """(path, kind, E, params per expert) of the block's experts, the first found in module order."""
    for name, mod in block.named_modules():
        if not name:
            continue
        if is_block_list(mod) and isinstance(mod, nn.ModuleList):
            per = sum(p.numel() for p in mod[0].parameters())
            if per > 0:
                return name, "ModuleList", len(mod), per
        e = _stacked_experts(mod)
        if e is not None:
            return name, "stacked", e, sum(p.numel() for p in mod.parameters()) // e
    return None


def _find_router(block: nn.Module, experts_path: str, num_experts: int) -> str | None:
    inside = experts_path + "."
    for name, mod in block.named_modules():
        if not name or name == experts_path or name.startswith(inside):
            continue
        if isinstance(mod, nn.Linear):
            if mod.out_features == num_experts:
                return name
            continue
        weight = getattr(mod, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[0] == num_experts:
            return name
    return None


def _top_k_from(obj: Any, num_experts: int, attrs: tuple[str, ...]) -> int | None:
    for attr in attrs:
        v = getattr(obj, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= num_experts:
            return v
    return None


def moe_of(model: nn.Module, block: nn.Module, observed_top_k: Callable[[], tuple[int, int] | None]) -> MoESpec | None:
    """The MoESpec of ``block`` (a block of ``model``), None when it has no experts.
    ``observed_top_k()`` returns (k, E) of the last router ``topk`` a meta forward called (or None);
    the experts need a router module or that call, so that a list of identical layers is not
    mistaken for experts."""
    found = _find_experts(block)
    if found is None:
        return None
    path, kind, num_experts, per = found
    router = _find_router(block, path, num_experts)
    seen = observed_top_k()
    routed = seen is not None and seen[1] == num_experts
    if router is None and not routed:
        return None  # identical sub-modules that no router chooses among are not experts
    cfg = getattr(model, "config", None)
    top_k, source = (_top_k_from(cfg, num_experts, _CONFIG_TOP_K), "config") if cfg is not None else (None, "")
    if top_k is None:
        for _, mod in block.named_modules():
            top_k = _top_k_from(mod, num_experts, _MODULE_TOP_K)
            if top_k is not None:
                source = "attribute"
                break
    if top_k is None:
        if not routed:
            return None
        top_k, source = seen[0], "topk call"
    return MoESpec(experts_path=path, experts_kind=kind, num_experts=num_experts, top_k=top_k,
                   top_k_source=source, params_per_expert=per, router_name=router)
