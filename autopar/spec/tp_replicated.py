"""Which replicated parameters of a tensor-parallel block compute on data that differs between the tp
ranks, read off the block's data flow on meta (one forward, never by module names).

On a tp rank every activation of the block is either *whole* -- the same tensor on every rank: the
block's input without SP, the all-gathered input of a colwise layer's parent under SP, a rowwise
output without SP -- or a *shard*: a colwise layer's output (this rank's heads) and, under SP, the
residual stream (this rank's positions). A parameter the plan does not shard lives whole on every
rank, and its local gradient is

* the full gradient when every op using it takes whole activations only and what it computes
  reaches the sharded heads only through colwise layers, whose input gradient DTensor sums over
  the ranks in backward (multi-head latent attention's ``q_a_proj`` and ``q_a_layernorm``): every
  rank holds the same full gradient, and a sum over tp would count it tp times;
* a partial sum -- this rank's heads or positions only -- when an op uses it on a shard (a norm of
  the per-head q or k, Gemma 3 and Qwen 3's ``q_norm``; under SP the residual-stream norms): it
  must be summed over tp (DTensor's ``SequenceParallel`` does, executor/parallel/tensor_parallel.py).

A whole activation computed with replicated parameters that enters an op together with a shard
directly (not as a colwise layer's input) gets only this rank's share of its gradient: MLA's shared
rotary key, which the plan's ``grad_sums`` adds up over the ranks at the layer's output (after
which the gradient upstream is whole again). Any other such path is a *leak*: no placement of the
parameters behind it trains them right, so tp (or SP) is refused with the reason.

Needs torch, never torch.distributed.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from autopar.spec.sp_check import _map_first, _parent, is_norm
from autopar.spec.tp_plan import ReplicatedFlow

__all__ = ["replicated_flow"]


# A tensor's state on a tp rank: ("param", names) computed from replicated parameters (and
# constants) alone; ("act", shard, ups) an activation, a shard or whole, with the replicated
# parameters a whole one was computed with since the last point where its gradient is summed (a
# colwise layer's input, a grad_sums layer's output)
_State = tuple


class _Tracker:
    def __init__(self, owners: Mapping[int, str], sequence_parallel: bool) -> None:
        self.owners = owners
        self.sp = sequence_parallel
        self.state: dict[int, _State] = {}
        self.keep: list[torch.Tensor] = []  # ids stay unique while the states are read
        self.on_shard: set[str] = set()
        self.leaks: set[str] = set()

    def of(self, t: torch.Tensor) -> _State | None:
        if id(t) in self.owners:
            return ("param", frozenset((self.owners[id(t)],)))
        return self.state.get(id(t))

    def mark(self, t: torch.Tensor, st: _State | None) -> None:
        if st is not None:
            self.state[id(t)] = st
            self.keep.append(t)

    def op(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        params: set[str] = set()
        acts: list[_State] = []
        for t in inputs:
            st = self.of(t)
            if st is None:
                continue  # a constant: a mask, a rotary table, a tensor the block made
            if st[0] == "param":
                params |= st[1]
            else:
                acts.append(st)
        if not acts:
            out: _State | None = ("param", frozenset(params)) if params else None
        elif any(a[1] for a in acts):
            self.on_shard |= params
            for a in acts:
                if not a[1]:
                    self.leaks |= a[2]  # a whole activation meets a shard: its gradient here is partial
            out = ("act", True, frozenset())
        else:
            out = ("act", False, frozenset().union(*(a[2] for a in acts)) | params)
        for t in outputs:
            self.mark(t, out)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class _Mode(TorchFunctionMode):
    """Every torch call outside the plan's layers, handed to the trackers with its tensors."""

    def __init__(self, trackers: list[_Tracker]) -> None:
        super().__init__()
        self.trackers = trackers
        self.skip = 0  # inside a tp layer: its output's state is set by its hook

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.skip:
            return out
        name = getattr(func, "__name__", "")
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        if (name.endswith("_") and not name.startswith("_")) or name == "__setitem__":
            outputs += inputs[:1]  # written in place: the target takes the result's state
        for tr in self.trackers:
            tr.op(inputs, outputs)
        return out


def replicated_flow(block: nn.Module, styles: Mapping[str, str], grad_sums: Mapping[str, int],
                    run: Callable[[], Any]) -> ReplicatedFlow | None:
    """The ReplicatedFlow of ``block`` (block 0, or a chain unit) under a TP plan (``styles``, its
    ``grad_sums``), from one meta forward ``run()`` of the model; None when the forward cannot be
    followed (the executor then keeps its plain rules). Never raises: the user's code runs here."""
    try:
        return _flow(block, styles, grad_sums, run)
    except Exception:  # noqa: BLE001 - the user's block code on meta
        return None


def _flow(block: nn.Module, styles: Mapping[str, str], grad_sums: Mapping[str, int],
          run: Callable[[], Any]) -> ReplicatedFlow | None:
    owners: dict[int, str] = {}  # a replicated parameter -> its block-relative name
    for name, mod in block.named_modules():
        if name in styles:
            continue
        for pname, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), f"{name}.{pname}" if name else pname)
    trackers = [_Tracker(owners, False), _Tracker(owners, True)]
    mode = _Mode(trackers)
    entered: list[bool] = []
    parents = {_parent(n) for n, s in styles.items() if s == "colwise"} - {""}

    def fresh(m: nn.Module, a: tuple, k: dict, state: Callable[[_Tracker, torch.Tensor], Any]
              ) -> tuple[tuple, dict] | None:
        """The module's first input as a new tensor in the state ``state(tracker, input)`` each tracker
        gives it (as the executor's split or gather hook hands it on)."""
        def mark(t: torch.Tensor) -> torch.Tensor:
            new = t.view_as(t)
            for tr in trackers:
                tr.mark(new, state(tr, t))
            return new
        return _map_first(m, a, k, mark)

    def enter(m: nn.Module, a: tuple, k: dict) -> tuple[tuple, dict] | None:
        if entered:
            return None  # a block called again (a shared unit): the first call is the one read
        mode.__enter__()
        entered.append(True)
        return fresh(m, a, k, lambda tr, t: ("act", tr.sp, frozenset()))

    def leave(m: nn.Module, a: tuple, out: Any) -> None:
        if len(entered) == 1:
            mode.__exit__(None, None, None)
            entered.append(False)

    def layer_in(m: nn.Module, a: tuple) -> None:
        mode.skip += 1

    def layer_out(style: str) -> Callable:
        def hook(m: nn.Module, a: tuple, out: Any) -> None:
            mode.skip -= 1
            for tr in trackers:
                for t in _tensors(out):
                    tr.mark(t, ("act", style == "colwise" or tr.sp, frozenset()))
        return hook

    def summed(m: nn.Module, a: tuple, out: Any) -> None:
        for tr in trackers:  # the executor sums this output's gradient: whole upstream of it
            for t in _tensors(out):
                st = tr.of(t)
                if st is not None and st[0] == "act":
                    tr.mark(t, ("act", st[1], frozenset()))

    handles = [block.register_forward_pre_hook(enter, with_kwargs=True), block.register_forward_hook(leave)]
    for name, style in styles.items():
        mod = block.get_submodule(name)
        handles += [mod.register_forward_pre_hook(layer_in), mod.register_forward_hook(layer_out(style))]
    for name in grad_sums:
        handles.append(block.get_submodule(name).register_forward_hook(summed))
    for p in parents:  # under SP the executor all-gathers the parent's input: whole there
        handles.append(block.get_submodule(p).register_forward_pre_hook(
            lambda m, a, k: fresh(m, a, k, lambda tr, t: ("act", False, frozenset()) if tr.sp else tr.of(t)),
            with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        if len(entered) == 1:  # the forward raised inside the block
            mode.__exit__(None, None, None)
        for h in handles:
            h.remove()
    if not entered:
        return None
    order = {n: i for i, n in enumerate(owners.values())}
    in_norm = {p for p in order if _parent(p) and is_norm(block.get_submodule(_parent(p)))}

    def ranked(names: set[str]) -> tuple[str, ...]:  # block order, a norm's parameters last
        return tuple(sorted(names, key=lambda n: (n in in_norm, order.get(n, 0))))
    shard = trackers[0].on_shard | trackers[1].on_shard
    return ReplicatedFlow(on_shard=ranked(trackers[0].on_shard), on_shard_sp=ranked(trackers[1].on_shard),
                          not_norms=ranked(shard - in_norm), leak=_leak(ranked(trackers[0].leaks)),
                          leak_sp=_leak(ranked(trackers[1].leaks)))


def _leak(leaks: tuple[str, ...]) -> str | None:
    if not leaks:
        return None
    return (f"{leaks[0]} computes a tensor that meets each tp rank's shard directly (not as a column-parallel "
            "layer's input): each rank would train it on its own share of the gradient")
