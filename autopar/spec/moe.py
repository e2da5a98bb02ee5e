"""Mixture-of-experts facts about a model's block: where the experts are, how many, how many each
token uses, and what they weigh (``MoESpec``; ``ModelSpec.moe``).

Found by behaviour, whatever the names: a router's top-k choice among E expert weights.

* E and top-k: the ``torch.topk`` over E scores (or a top-1 ``argmax``) one meta forward of the model
  calls (autopar.spec.meta's routing); top-k also from the model config (``num_experts_per_tok`` and
  its aliases, nested configs such as DBRX's ``ffn_config`` included) or a ``top_k`` attribute of the
  MoE modules.
* the router: the block's module outside the experts whose 2-D weight maps the width to E scores
  (an ``nn.Linear(d, E)``, HF's ``*TopKRouter``, with or without a bias).
* the experts: an ``nn.ModuleList`` of E identical modules (hand-written MoE, older Hugging Face
  code), or a module that does not hold the router and whose parameters are all per expert --
  stacked with E leading (3-D weights, 2-D per-expert biases: Hugging Face's ``MixtralExperts``,
  ``GptOssExperts``, a plain-torch grouped-experts module), or packed along their rows (E x f rows
  viewed per expert inside the forward: DBRX's ``w1`` / ``v1`` / ``w2``). Without a routing call
  seen, the experts are read from structure alone (a ModuleList, or 3-D stacks with one leading E)
  and need a router module; identical sub-modules no router chooses among are not experts.
* how stacked experts are called (``MoESpec.call``): the arguments of the experts module's forward
  that carry the token rows, the top-k expert indices (integer, (tokens, k)) and their weights
  (floating, (tokens, k)), by position or keyword, seen on meta. Expert parallelism calls the
  model's own expert code on each rank's rows through them. Or (``MoESpec.grouped``) the rows
  already grouped by expert and the rows per expert (E counts summing to the rows: the rows of
  expert e are the next counts[e] rows), the MoE module's own code doing the routing, gating and
  scatter around them (JetMoE's ``ParallelExperts``): every sibling stack the MoE module calls so
  is one of the same experts (an up and a down projection), and expert parallelism sends each
  call's grouped rows to the ranks holding their experts.
* shared experts (a dense MLP every token goes through beside the routed ones, Qwen-MoE's or
  DeepSeek's ``shared_experts``) are not experts here: they hold no per-expert parameters, so they
  stay with the block's dense part (replicated over ep, sharded by TP where its plan says so).

The graph counts expert compute at the expected tokens per expert (tokens x top_k / E, balanced
routing; autopar.spec.meta); this object is what expert parallelism and the planner read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from autopar.spec.blocks import is_block_list

# Config names of top-k (not plain ``top_k``: on a model config that is a sampling setting).
_CONFIG_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "num_selected_experts",
                 "router_top_k", "n_activated_experts")
_MODULE_TOP_K = _CONFIG_TOP_K + ("top_k", "k")
# Sub-configs of a model config that may hold the MoE settings (DBRX's ffn_config).
_SUB_CONFIGS = ("ffn_config", "moe_config", "text_config")
# The roles of a stacked experts module's forward arguments (MoESpec.call): rows, indices, weights.
CALL_ROLES = ("rows", "indices", "weights")
# ... and of one called with its rows grouped by expert (MoESpec.grouped): the module, rows, counts.
GROUPED_ROLES = ("path", "rows", "counts")


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """One block's mixture of experts. Names are block-relative dotted paths."""

    experts_path: str
    experts_kind: str  # "ModuleList" (one module per expert) | "stacked" (parameters per expert, E first)
    num_experts: int
    top_k: int
    top_k_source: str  # "config" | "attribute" | "topk call"
    params_per_expert: int
    router_name: str | None
    # stacked experts: where their forward takes (rows, top-k indices, top-k weights) -- a position
    # ("0", "1", ...) or a keyword each; None where the meta forward showed no such call
    call: tuple[str, str, str] | None = None
    # stacked experts called with their rows already grouped by expert and the rows per expert
    # (GROUPED_ROLES): every stack of the mixture so called, (block-relative path, where its forward
    # takes the rows, where the counts), experts_path's first; its siblings' parameters are counted
    # in params_per_expert. Empty where the meta forward showed no such call
    grouped: tuple[tuple[str, str, str], ...] = ()
    # the width of each grouped stack's rows and of its results (seen on meta): what expert
    # parallelism exchanges, there and back, for each of them
    grouped_widths: tuple[tuple[int, int], ...] = ()

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
    def paths(self) -> tuple[str, ...]:
        """Every module holding these experts' parameters (one but for grouped stacks)."""
        return tuple(g[0] for g in self.grouped) or (self.experts_path,)

    @property
    def exchange_factor(self) -> float:
        """The bytes expert parallelism exchanges for one MoE layer over one dispatch and one
        combine of the tokens (the first grouped stack's rows): 1 but for grouped stacks, each of
        which sends its rows and gets its results back (JetMoE: (d + 2f + f + d) / 2d)."""
        if not self.grouped_widths:
            return 1.0
        return sum(a + b for a, b in self.grouped_widths) / (2 * self.grouped_widths[0][0])

    @property
    def active_fraction(self) -> float:
        """The share of expert parameters one token uses (top_k / E)."""
        return self.top_k / self.num_experts

    def describe(self) -> str:
        return (f"{self.num_experts} experts at {self.experts_path}, top-{self.top_k} ({self.top_k_source}), "
                f"{self.params_per_expert:,} parameters each, router {self.router_name or 'not found'}")


def _is_torch_layer(mod: nn.Module) -> bool:
    return type(mod).__module__.startswith("torch.nn")  # a Conv1d weight is 3-D too: never a stack of experts


def _structural_stack(mod: nn.Module) -> int | None:
    """E when every parameter ``mod`` owns directly is stacked per expert (>= 3-D, or a 2-D
    per-expert bias next to them) with one leading dimension E >= 2 (no routing call seen)."""
    if _is_torch_layer(mod):
        return None
    params = list(mod.parameters(recurse=False))
    if not params or not any(p.dim() >= 3 for p in params):
        return None
    leading = {p.shape[0] for p in params if p.dim() >= 2}
    if len(leading) != 1 or any(p.dim() < 2 for p in params):
        return None
    e = leading.pop()
    return e if e >= 2 else None


def _per_expert_stack(mod: nn.Module, num_experts: int) -> bool:
    """Whether every parameter under ``mod`` is per expert for E = ``num_experts``: stacked (E
    leading, >= 2-D) or packed (E x f rows of a 2-D weight), with at least one that is not a plain
    (E, d) matrix (which is what a router's weight looks like)."""
    if any(_is_torch_layer(m) and any(True for _ in m.parameters(recurse=False)) for m in mod.modules()):
        return False  # a module of torch layers (attention's Linears) is not a stack of experts
    params = list(mod.parameters())
    if not params or any(p.dim() < 2 or p.shape[0] % num_experts for p in params):
        return False
    return any(p.dim() >= 3 or p.shape[0] > num_experts for p in params)


def _find_experts(block: nn.Module, num_experts: int | None, router: str | None,
                  routed: Callable[[nn.Module], bool] = lambda _m: False) -> tuple[str, str, int, int] | None:
    """(path, kind, E, params per expert) of the block's experts, the first found in module order.
    ``num_experts``: E of the routing the meta forward saw (None: structure alone); ``router``: the
    router's path, which an experts module never holds; ``routed(module)``: whether the meta
    forward called it with the routing (needed of weights packed in 2-D, whose shapes alone could
    be any layer's)."""
    for name, mod in block.named_modules():
        if not name:
            continue
        if is_block_list(mod) and isinstance(mod, nn.ModuleList) and num_experts in (None, len(mod)):
            per = sum(p.numel() for p in mod[0].parameters())
            if per > 0:
                return name, "ModuleList", len(mod), per
        if num_experts is None:
            e = _structural_stack(mod)
        else:
            holds_router = router is not None and (router == name or router.startswith(name + "."))
            e = num_experts if not holds_router and _per_expert_stack(mod, num_experts) else None
            if e is not None and all(p.dim() == 2 for p in mod.parameters()) and not routed(mod):
                e = None
        if e is not None:
            return name, "stacked", e, sum(p.numel() for p in mod.parameters()) // e
    return None


def _find_router(block: nn.Module, num_experts: int, outside: str | None = None) -> str | None:
    """The block's module (outside ``outside``, the experts) mapping the width to ``num_experts`` scores."""
    for name, mod in block.named_modules():
        if not name or (outside is not None and (name == outside or name.startswith(outside + "."))):
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


def _config_top_k(cfg: Any, num_experts: int) -> int | None:
    for c in (cfg, *(getattr(cfg, n, None) for n in _SUB_CONFIGS)):
        k = _top_k_from(c, num_experts, _CONFIG_TOP_K) if c is not None else None
        if k is not None:
            return k
    return None


def routed_call(args: tuple, kwargs: dict, top_k: int) -> tuple[str, str, str] | None:
    """Where a stacked experts module's call (``args``, ``kwargs``, as its forward received them)
    passes the token rows, the top-k indices and their weights (CALL_ROLES; positions as "0", "1",
    ...), or None when the call does not carry them: indices an integer (tokens, k) tensor, weights
    a floating tensor of that shape, rows a floating tensor of as many rows."""
    items = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
    tensors = [(key, t) for key, t in items if isinstance(t, torch.Tensor)]
    index = next(((key, t) for key, t in tensors if not t.is_floating_point() and t.dtype != torch.bool
                  and t.dim() == 2 and t.shape[-1] == top_k), None)
    if index is None:
        return None
    shape = tuple(index[1].shape)
    weights = next((key for key, t in tensors if t.is_floating_point() and tuple(t.shape) == shape), None)
    tokens = shape[0]
    rows = next((key for key, t in tensors if key not in (index[0], weights) and t.is_floating_point()
                 and t.dim() >= 2 and t.numel() == tokens * t.shape[-1]), None)
    if weights is None or rows is None:
        return None
    return rows, index[0], weights


def grouped_call(args: tuple, kwargs: dict, num_experts: int) -> tuple[str, str] | None:
    """Where a stacked experts module's call passes its rows grouped by expert and the rows per
    expert (positions as "0", "1", ...), or None when it does not: the counts a list or tuple of
    ``num_experts`` ints, or a 1-D integer tensor of that many, and the rows a floating 2-D tensor
    of as many rows as the counts sum to (on meta, the balanced counts autopar.spec.meta answers; a
    meta tensor of counts has no sum to read, and any 2-D floating tensor beside it is the rows)."""
    items = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())

    def total(v: Any) -> int | None:  # -1: a count of rows not known (a meta tensor)
        if isinstance(v, (list, tuple)) and len(v) == num_experts and all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v):
            return sum(v)
        if (isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == num_experts
                and not v.is_floating_point() and v.dtype != torch.bool):
            return -1 if v.device.type == "meta" else int(v.sum())
        return None

    counts = next(((key, n) for key, v in items if (n := total(v)) is not None), None)
    if counts is None:
        return None
    rows = next((key for key, t in items if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dim() == 2 and counts[1] in (-1, t.shape[0])), None)
    return None if rows is None else (rows, counts[0])


def _grouped_stacks(block: nn.Module, path: str, num_experts: int,
                    first_call: Callable[[nn.Module], tuple[tuple, dict] | None]) -> tuple[tuple[str, str, str], ...]:
    """The stacks of one mixture called with grouped rows and counts: the experts module at
    ``path`` and its siblings (children of the module holding it, the MoE module whose own code
    calls them) that are per expert for the same E and called so; () where ``path`` is not."""
    def read(p: str) -> tuple[str, str, str] | None:
        called = first_call(block.get_submodule(p))
        found = grouped_call(*called, num_experts) if called is not None else None
        return None if found is None else (p, *found)

    first = read(path)
    if first is None:
        return ()
    owner_path = path.rpartition(".")[0]
    owner = block.get_submodule(owner_path) if owner_path else block
    siblings = [f"{owner_path}.{n}" if owner_path else n for n, m in owner.named_children()
                if not _is_torch_layer(m) and _per_expert_stack(m, num_experts)]
    return (first,) + tuple(g for p in siblings if p != path and (g := read(p)) is not None)


def moe_of(model: nn.Module, block: nn.Module, observed_top_k: Callable[[], tuple[int, int] | None],
           first_call: Callable[[nn.Module], tuple[tuple, dict] | None] = lambda _m: None,
           first_output: Callable[[nn.Module], Any] = lambda _m: None) -> MoESpec | None:
    """The MoESpec of ``block`` (a block of ``model``), None when it has no experts.
    ``observed_top_k()`` returns (k, E) of the router ``topk`` a meta forward called (or None);
    ``first_call(module)`` the (args, kwargs) a meta forward first called ``module`` with (None: not
    called), ``first_output(module)`` what that call returned. The experts need a router module or
    that topk call, so that a list of identical layers is not mistaken for experts."""
    seen = observed_top_k()
    found, router = None, None
    if seen is not None:  # by behaviour: E from the routing, the router mapping the width to E scores
        def routed(mod: nn.Module) -> bool:
            called = first_call(mod)
            return called is not None and routed_call(*called, seen[0]) is not None

        router = _find_router(block, seen[1])
        found = _find_experts(block, seen[1], router, routed)
        if found is not None and router is not None and (router + ".").startswith(found[0] + "."):
            router = _find_router(block, seen[1], found[0])  # an expert's own layer, not the router
    if found is None:  # by structure alone (no routing seen, or not in this block)
        found = _find_experts(block, None, None)
        if found is None:
            return None
        router = _find_router(block, found[2], found[0])
    path, kind, num_experts, per = found
    routed = seen is not None and seen[1] == num_experts
    if router is None and not routed:
        return None  # identical sub-modules that no router chooses among are not experts
    cfg = getattr(model, "config", None)
    top_k, source = (_config_top_k(cfg, num_experts), "config") if cfg is not None else (None, "")
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
    call, grouped, widths = None, (), ()
    if kind == "stacked":
        called = first_call(block.get_submodule(path))
        call = routed_call(*called, top_k) if called is not None else None
        if call is None:
            grouped = _grouped_stacks(block, path, num_experts, first_call)
            per += sum(p.numel() for g in grouped[1:] for p in block.get_submodule(g[0]).parameters()) // num_experts
            widths = _grouped_widths(block, grouped, first_call, first_output)
    return MoESpec(experts_path=path, experts_kind=kind, num_experts=num_experts, top_k=top_k,
                   top_k_source=source, params_per_expert=per, router_name=router, call=call, grouped=grouped,
                   grouped_widths=widths)


def _grouped_widths(block: nn.Module, grouped: tuple[tuple[str, str, str], ...],
                    first_call: Callable[[nn.Module], tuple[tuple, dict] | None],
                    first_output: Callable[[nn.Module], Any]) -> tuple[tuple[int, int], ...]:
    """(rows width, results width) of each grouped stack's first call; () where a result is not one
    2-D tensor (the exchange is then priced as one dispatch and combine)."""
    widths = []
    for path, rows_at, _ in grouped:
        module = block.get_submodule(path)
        args, kwargs = first_call(module)
        out = first_output(module)
        rows = args[int(rows_at)] if rows_at.isdigit() else kwargs[rows_at]
        if not (isinstance(out, torch.Tensor) and out.dim() == 2):
            return ()
        widths.append((int(rows.shape[-1]), int(out.shape[-1])))
    return tuple(widths)


def routes_among(model: nn.Module, list_path: str, observed: tuple[int, int] | None) -> bool:
    """Whether the list at ``list_path`` holds a layer's experts rather than the model's blocks: the
    meta forward routed top-k among as many experts as it holds (``observed``: (top_k, experts)),
    and the module holding it also holds a router scoring that many, outside the list."""
    if observed is None or not list_path:
        return False
    experts = model.get_submodule(list_path)
    if observed[1] != len(experts):
        return False
    parent_path, _, name = list_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    return _find_router(parent, len(experts), outside=name) is not None
