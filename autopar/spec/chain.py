"""The layer chain of a model that does not repeat one block, and where a pipeline may cut it.

A *chain* is the ordered list of a model's top-level units: the children of its outermost
``nn.ModuleList`` / ``nn.Sequential`` containers (containers inside a unit do not count; a list of
lists is looked through to its lists), in the order one meta forward calls them. A ResNet's chain is every residual block of ``layer1`` ..
``layer4`` (stem before, pool and head after); T5's is ``encoder.block.*`` then ``decoder.block.*``.
Models whose blocks repeat keep their block list (spec/blocks.py); a block list kept in an
``nn.Sequential`` is cut by the same mechanism as a chain (its children are the units).

Chain positions: position 0 is before unit 0 (the prologue), position p (0 < p < L) the code
between unit p-1 and unit p ("glue"), position L after the last unit (the epilogue). A pipeline
chunk holding units [s, e) runs, for real, position 0 if s == 0, every position p with s < p <= e
(the glue before its exit at unit e's input belongs to it) and position L if e == L; positions
p <= s of a later chunk run on meta, on stubs (executor/parallel/pipeline_parallel.py).

Units of one class with equal parameter shapes that receive an input of equal shape share a
measurement (``Chain.kinds``), as repeated blocks do. ``Chain.pp_reason`` says why a pipeline
cannot cut the chain (None: it can).

A chain that is exactly the children of one ``nn.ModuleList``, called in index order (a block list
whose blocks differ in structure: DeepSeek-V2/V3's dense first layers then MoE layers, Llama 4's
interleaved MoE) names that list in ``Chain.block_list``. The pipeline then cuts it as a block list
(executor/parallel/pipeline_parallel.py: every stage runs the model's own forward, so masks and rotary tables
the forward hands each block beside its hidden state are computed on every stage), and
``pp_reason`` holds that mechanism's requirements instead of the chain's; the planner still prices
the chain's units one by one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from autopar.errors import ModelFileError
from autopar.spec.blocks import BLOCK_CONTAINERS, BlockCall, Probe, _signature


@dataclass(frozen=True, kw_only=True)
class Chain:
    """The units of a chain and what the meta probe saw of them (see the module docstring).

    ``kinds[i]``: index of the first unit measured for unit i (itself when it is the first of its
    class, shapes and input shape). ``modules``: each module outside the chain that ran -> the
    positions it ran at. ``bare``: each parameter owned by the root or by an ancestor of a unit
    -> the positions whose code used it. ``input_shapes[i]`` / ``output_shapes[i]``: unit i's first
    tensor argument and the first tensor of its output at one sample (() when there is none).
    """

    units: tuple[str, ...]
    containers: tuple[str, ...]
    kinds: tuple[int, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...] = ()
    modules: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    bare: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    pp_reason: str | None = None
    block_list: str | None = None  # the nn.ModuleList the units are, in order (module docstring)
    skipped: tuple[int, ...] = ()  # units the forward did not run (their parameters held, no time)
    probe: Probe | None = None  # the same forward read as spec/blocks.py reads a block list's

    def __post_init__(self) -> None:
        n = len(self.units)
        if n < 1 or len(self.kinds) != n or len(self.input_shapes) != n:
            raise ValueError("a chain needs one kind and one input shape per unit")
        if any(not 0 <= k <= i or self.kinds[k] != k for i, k in enumerate(self.kinds)):
            raise ValueError("kinds[i] must name an earlier (or the same) unit that is its own kind")
        if self.block_list is not None and self.units != tuple(f"{self.block_list}.{i}" for i in range(n)):
            raise ValueError("a chain read as a block list has that list's children as its units, in index order")

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def prologue(self) -> tuple[str, ...]:
        return tuple(n for n, pos in self.modules.items() if pos == (0,))

    @property
    def epilogue(self) -> tuple[str, ...]:
        return tuple(n for n, pos in self.modules.items() if pos == (self.num_units,))


def outermost_containers(model: nn.Module, exclude: frozenset[str] = frozenset()) -> list[str]:
    """ModuleList / Sequential submodules holding at least one parameterised child, none of them
    inside another such container; a container of containers is looked through; those in
    ``exclude`` (a layer's experts) are no containers of units."""
    found: list[str] = []
    for name, mod in model.named_modules():
        if not name or name in exclude or not isinstance(mod, BLOCK_CONTAINERS) or len(mod) == 0:
            continue
        if any(name.startswith(c + ".") for c in found):
            continue
        if all(isinstance(c, nn.ModuleList) for c in mod.children()):
            # a list of lists (Funnel's blocks of layers between poolings): the forward iterates the
            # inner lists and calls their children, so the inner lists are the containers (an
            # nn.Sequential is called as a whole: a list of them is a list of units)
            continue
        if any(any(True for _ in child.parameters()) for child in mod.children()):
            found.append(name)
    return found


class _UseRecorder(TorchFunctionMode):
    """Notes at which chain position each watched parameter is read by an op."""

    def __init__(self, watched: dict[int, str], position: list[int], uses: dict[str, set[int]]) -> None:
        super().__init__()
        self.watched, self.position, self.uses = watched, position, uses

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        for a in tree_flatten((args, kwargs))[0]:
            name = self.watched.get(id(a)) if isinstance(a, torch.Tensor) else None
            if name is not None:
                self.uses.setdefault(name, set()).add(self.position[0])
        return func(*args, **kwargs)


def _ancestors(units: list[str]) -> set[str]:
    out = {""}
    for u in units:
        parts = u.split(".")
        out.update(".".join(parts[:d]) for d in range(1, len(parts)))
    return out


def _outside_modules(model: nn.Module, units: list[str]) -> dict[str, nn.Module]:
    """Children of the units' ancestors that are neither units nor ancestors (the stem, glue, head)."""
    anc, unit_set = _ancestors(units), set(units)
    out: dict[str, nn.Module] = {}
    for prefix in sorted(anc):
        parent = model.get_submodule(prefix) if prefix else model
        for name, child in parent.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if full not in anc and full not in unit_set:
                out[full] = child
    return out


def _bare_params(model: nn.Module, units: list[str]) -> dict[int, str]:
    out: dict[int, str] = {}
    for prefix in sorted(_ancestors(units)):
        owner = model.get_submodule(prefix) if prefix else model
        for name, p in owner.named_parameters(recurse=False):
            out.setdefault(id(p), f"{prefix}.{name}" if prefix else name)
    return out


def probe_chain(model: nn.Module, units: list[str], run: Callable[[], Any]) -> Chain:
    """Run ``run()`` (one meta forward of ``model`` at one sample) and read the chain of ``units``
    (in any order; the forward's call order is the chain's)."""
    calls: list[int] = []
    info: dict[int, dict[str, Any]] = {}
    position = [0]
    ran: dict[str, set[int]] = {}
    handles = []
    mods = [model.get_submodule(u) for u in units]
    for i, mod in enumerate(mods):
        def pre(m: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            calls.append(i)
            position[0] = len(calls)  # later glue: after this unit
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            info.setdefault(i, {"first": first, "extra": len(tensors) - (first is not None),
                                "num_args": len(args), "kwargs": tuple(sorted(kwargs))})

        def post(m: nn.Module, args: tuple, out: Any, i: int = i) -> None:
            info[i].setdefault("out", out)

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    returned: dict[str, str] = {}
    for name, mod in _outside_modules(model, units).items():
        handles.append(mod.register_forward_pre_hook(
            lambda m, a, n=name: ran.setdefault(n, set()).add(position[0])))
        def note_output(m: nn.Module, a: tuple, o: Any, n: str = name) -> None:  # returns None: output unchanged
            returned.setdefault(n, "Tensor" if isinstance(o, torch.Tensor) else type(o).__name__)

        handles.append(mod.register_forward_hook(note_output))
    watched = _bare_params(model, units)
    uses: dict[str, set[int]] = {}
    try:
        with torch.no_grad(), (_UseRecorder(watched, position, uses) if watched else contextlib.nullcontext()):
            run()
    finally:
        for h in handles:
            h.remove()
    if not calls:
        raise ModelFileError(f"the model's forward never called its units ({units[0]}, ...)")
    ran_order = list(dict.fromkeys(calls))
    repeated = next((units[i] for i in ran_order if calls.count(i) > 1), None)
    twice = f"{repeated}: {calls.count(units.index(repeated))} calls" if repeated is not None else ""
    # A unit the forward skips (Mllama's cross-attention layers on a text batch) stays in the chain,
    # before the next unit of its container that ran: its parameters are held, it costs no time.
    order = _with_skipped(units, ran_order)
    for i in order:
        info.setdefault(i, {"first": None, "extra": 0, "num_args": 0, "kwargs": (), "skipped": True})
    if len(order) != len(ran_order) and not twice:
        at = {0: 0, **{p: order.index(ran_order[p - 1]) + 1 for p in range(1, len(ran_order) + 1)}}
        ran = {n: {at.get(p, p) for p in pos} for n, pos in ran.items()}
        uses = {n: {at.get(p, p) for p in pos} for n, pos in uses.items()}
    ordered = [units[i] for i in order]
    L = len(ordered)
    # positions were counted in calls; with each unit called once they are chain positions
    shapes = tuple(tuple(info[i]["first"].shape) if info[i]["first"] is not None else () for i in order)
    outs = tuple(_first_shape(info[i].get("out")) for i in order)
    sigs = [(_signature(mods[i]), shapes[k]) for k, i in enumerate(order)]
    kinds = tuple(sigs.index(s) for s in sigs)
    modules = {n: tuple(sorted(p)) for n, p in ran.items()}
    bare = {n: tuple(sorted(p)) for n, p in uses.items()}
    for name in watched.values():
        bare.setdefault(name, ())
    reason = _pp_reason(ordered, [info[i] for i in order], modules, bare, twice, L)
    first, last = info[ran_order[0]], info[ran_order[-1]]
    # after the last call: position L, or the call count where a shared unit ran at every depth
    # (positions then stay counted in calls: ALBERT's head runs at position 12 of a 1-unit chain)
    end = len(calls) if twice else L
    probe = Probe(prologue=tuple((n, returned.get(n, "Tensor")) for n, pos in modules.items() if pos == (0,)),
                  epilogue=tuple(n for n, pos in modules.items() if pos == (end,)),
                  block_call=BlockCall(num_args=first["num_args"], kwargs=first["kwargs"],
                                       first_arg_is_tensor=first["first"] is not None),
                  block_output="Tensor" if isinstance(last.get("out"), torch.Tensor) else type(last.get("out")).__name__)
    return Chain(probe=probe, units=tuple(ordered), containers=(), kinds=kinds, input_shapes=shapes, output_shapes=outs,
                 modules=modules, bare=bare, pp_reason=reason,
                 skipped=tuple(k for k, i in enumerate(order) if info[i].get("skipped")))


_TWICE = "the forward calls a chain unit more than once"
_SKIPPED = "the forward skips a unit that holds parameters"


def _with_skipped(units: list[str], ran: list[int]) -> list[int]:
    """``ran`` (unit indices in call order) with every unit that did not run placed before the
    next unit of its container that did (after the last unit when none did)."""
    container = [u.rpartition(".")[0] for u in units]
    skipped = [j for j in range(len(units)) if j not in set(ran)]
    out: list[int] = []
    for i in ran:
        out += [j for j in skipped if j < i and container[j] == container[i] and j not in out]
        out.append(i)
    return out + [j for j in skipped if j not in out]


def _first_shape(value: Any) -> tuple[int, ...]:
    """Shape of the first tensor in a unit's output (a tuple's hidden states), () if none."""
    t = next((v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)), None)
    return () if t is None else tuple(t.shape)


def _pp_reason(units: list[str], info: list[dict[str, Any]], modules: Mapping[str, tuple[int, ...]],
               bare: Mapping[str, tuple[int, ...]], twice: str, L: int) -> str | None:
    """Why a pipeline cannot cut this chain at unit inputs (None: it can). ``twice``: the first unit
    the forward calls more than once, and how often ("" when none is)."""
    if twice:
        return f"{_TWICE} ({twice}, one set of weights shared across depths)"
    skipped = next((name for name, inf in zip(units, info) if inf.get("skipped")), None)
    if skipped is not None:
        return f"{_SKIPPED} ({skipped}); a stage boundary at it would never be reached"
    for name, inf in zip(units, info):
        if inf["first"] is None:
            return f"{name} takes its input as a keyword argument; the pipeline cuts at a unit's first positional input"
    containers = [u.rsplit(".", 1)[0] for u in units]
    readers = [(c != containers[0], n) for n, c, inf in zip(units, containers, info) if inf["extra"]]
    if readers:
        later, name = max(readers, key=lambda x: x[0])  # a later container's reader names the second stream
        what = ("it reads tensors beside its input from outside its own stack (an encoder-decoder's decoder reads "
                "the encoder output)" if later else "it also reads tensors beside its input (masks, position tables)")
        return f"{name}: {what}; the pipeline carries one activation between stages"
    for name, inf in zip(units, info):
        out = inf.get("out")
        if not isinstance(out, torch.Tensor):
            return f"{name} returns a {type(out).__name__}, not a tensor"
    for name, pos in modules.items():
        if len(pos) > 1:
            return f"{name} runs at {len(pos)} places of the chain; a pipeline stage holds a module once"
    for name, pos in bare.items():
        if len(pos) > 1:
            return f"parameter {name} is used at {len(pos)} places of the chain; a pipeline stage holds it once"
    return None


def find_chain(model: nn.Module, run: Callable[[], Any], exclude: frozenset[str] = frozenset()) -> Chain | None:
    """The chain of ``model`` (see the module docstring), or None when it has fewer than 2 units
    and no unit the forward calls more than once (ALBERT's one layer group applied at every depth:
    a chain of one unit whose region holds every call, its parameters counted once). ``exclude``:
    containers that are no units' (a layer's experts)."""
    containers = outermost_containers(model, exclude)
    units = [f"{c}.{k}" for c in containers for k, _ in model.get_submodule(c).named_children()]
    if not units:
        return None
    chain = dataclasses.replace(probe_chain(model, units, run), containers=tuple(containers))
    if len(units) < 2 and not (chain.pp_reason or "").startswith(_TWICE):
        return None
    if len(containers) == 1 and isinstance(model.get_submodule(containers[0]), nn.ModuleList) \
            and chain.units == tuple(units):
        return dataclasses.replace(chain, block_list=containers[0], pp_reason=_block_list_reason(chain))
    return chain


def _block_list_reason(chain: Chain) -> str | None:
    """Why the block-list pipeline (executor/parallel/pipeline_parallel.py, its Requirements) cannot cut
    ``chain`` read as a block list (None: it can). The blocks' order was checked by the caller; a
    block called twice (a shared layer) would be placed on one stage only."""
    if chain.pp_reason and chain.pp_reason.startswith(_SKIPPED):
        return chain.pp_reason
    if chain.pp_reason and chain.pp_reason.startswith(_TWICE):
        detail = chain.pp_reason[len(_TWICE):].strip()
        return f"the forward calls a block more than once {detail}; a pipeline stage holds each block once"
    call = chain.probe.block_call if chain.probe is not None else None
    if call is not None and not call.first_arg_is_tensor and call.num_args == 0 and not call.kwargs:
        return "the blocks are called without a hidden-state input a stage could receive"
    return None


def block_list_chain(model: nn.Module, blocks_path: str, run: Callable[[], Any]) -> Chain:
    """The block list at ``blocks_path`` read as a chain (an nn.Sequential of blocks is cut this way)."""
    blocks = model.get_submodule(blocks_path)
    units = [f"{blocks_path}.{k}" for k, _ in blocks.named_children()]
    return dataclasses.replace(probe_chain(model, units, run), containers=(blocks_path,))
