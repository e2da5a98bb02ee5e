"""Whether Megatron sequence parallelism, as the executor applies it, runs a model's block exactly.

Under SP (executor/tensor_parallel.apply_tp) the residual stream between blocks is a shard of the
sequence (dim 1); a norm runs on the shard; the *parent module* of each colwise layer gets its first
input all-gathered over the sequence by a pre-hook; each rowwise layer's output is reduce-scattered
back to the shard. That is exact only when, inside the block, everything that mixes tokens sits
behind a gathered parent and every parameter is either sharded by TP or a norm's (whose gradient
DTensor sums over the tp ranks). ``sp_check`` answers for block 0, in three steps, the first that
fails giving the reason (one line):

1. *parameters*: every parameter belongs to a tp layer or a norm; any other (an attention whose
   pair inference refused, a bare bias) would be trained by each rank on its own shard only --
   unless the block's data flow (``TPPlan.flow``, spec/tp_replicated.py) shows it computing on whole
   tensors only (multi-head latent attention's ``q_a_proj`` on the all-gathered input), which every
   rank then runs whole with the full gradient; a norm on whole tensors is left out of
   ``SequenceParallel`` (its gradient must not be summed), and a whole tensor meeting a shard other
   than as a colwise layer's input is refused;
2. *calls*: every colwise layer has a parent module below the block, and the block calls that parent
   (a block that calls ``self.qkv.proj(x)`` directly never runs ``self.qkv``'s hook);
3. *numbers* (blocks small enough, as for the tp check): two threads run the block as the two ranks
   of tp = 2 with the hooks above (gather = concatenate, reduce-scatter = sum then slice) in float64
   on CPU; their concatenated outputs must equal the full block's.

Needs torch, never torch.distributed.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autopar.spec.tp_infer import _MAX_CHECK_INPUT, _MAX_CHECK_PARAMS, _RTOL, _materialise, _rank_copy, _real
from autopar.spec.tp_plan import ReplicatedFlow

_TP = 2
_RTOL_FP32 = 1e-4  # the numeric check in float32 (stacked experts), summing a few hundred products


def is_norm(mod: nn.Module) -> bool:
    """A module the executor runs under DTensor's ``SequenceParallel`` (its parameters replicated, the
    sequence shard in, gradients summed over the tp ranks): a norm, or a module that holds only
    per-channel vectors and no layer (DINOv2's ``Dinov2LayerScale``, a learned per-channel gate),
    which like a norm's weight acts on each position alone -- step 3's simulation checks that it does."""
    if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or type(mod).__name__.endswith("Norm"):
        return True
    own = list(mod.parameters(recurse=False))
    return bool(own) and all(p.dim() <= 1 for p in own) and len(own) == len(list(mod.parameters()))


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _first_param(mod: nn.Module) -> str | None:
    try:
        params = list(inspect.signature(type(mod).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return named[0].name if named else None


def _map_first(mod: nn.Module, args: tuple, kwargs: dict, fn: Callable[[Any], Any]) -> tuple[tuple, dict] | None:
    """(args, kwargs) with ``fn`` applied to the module's first input (as tensor_parallel does), or
    None when there is none."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    name = _first_param(mod)
    if name is not None and isinstance(kwargs.get(name), torch.Tensor):
        return args, {**kwargs, name: fn(kwargs[name])}
    return None


def _first_tensor(value: Any) -> torch.Tensor | None:
    return next((t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)), None)


def _under(name: str, prefixes: Any) -> bool:
    return any(name == n or name.startswith(n + ".") for n in prefixes)


def shard_local_modules(block: nn.Module, styles: Mapping[str, str], moe_module: str) -> tuple[str, ...] | str:
    """The children of a mixture-of-experts module ``moe_module`` (block-relative) that run on a tp
    rank's sequence shard under sequence parallelism: those holding parameters, no tensor-parallel
    layer and no colwise parent (whose input is all-gathered) -- the router, the routed experts, an
    unsharded shared expert and its gate. Each tp rank trains them on its own tokens, so the
    executor reduces their gradients over dp x cp x tp (autopar.layout's ``moe_dp``; the experts
    over its ``edp``). A string: why the module cannot run so (one line)."""
    moe = block.get_submodule(moe_module)
    if any(True for _ in moe.parameters(recurse=False)):
        return (f"{moe_module} holds parameters of its own beside its submodules: sequence parallelism reduces a "
                "mixture of experts' gradients over the tp ranks submodule by submodule")
    gathered = {_parent(n) for n, s in styles.items() if s == "colwise"}
    if _under(moe_module, gathered):
        return (f"{moe_module} gets its input all-gathered (a colwise layer's parent): its router would see the "
                "whole sequence on every tp rank")
    out = []
    for child, mod in moe.named_children():
        path = f"{moe_module}.{child}"
        if not any(True for _ in mod.parameters()):
            continue
        if any(_under(n, (path,)) for n in styles):
            continue  # a tensor-parallel shared expert: its own layers (a stray parameter is refused later)
        out.append(path)
    return tuple(out)


def _stray_parameter(block: nn.Module, styles: Mapping[str, str], local: tuple[str, ...] = (),
                     flow: ReplicatedFlow | None = None) -> str | None:
    if flow is not None:  # by data flow: whole-input layers (MLA's q_a_proj) run whole on every rank
        return flow.reason(True, local)
    norms = {n for n, m in block.named_modules() if is_norm(m)}
    for name, _ in block.named_parameters():
        owner = _parent(name)
        if owner in styles or _under(owner, norms) or _under(owner, local):
            continue
        return (f"{name} is in neither a tensor-parallel layer nor a norm: under sequence parallelism each "
                "tp rank would compute with it on its own sequence shard")
    return None


def sp_check(block: nn.Module, styles: Mapping[str, str], fused: Mapping[str, int], local_attrs: tuple[str, ...],
             run: Callable[[], Any], moe_module: str | None = None,
             flow: ReplicatedFlow | None = None) -> tuple[str | None, tuple[str, ...]]:
    """(None when SP runs ``block`` (block 0; ``run()`` one meta forward of the model) exactly, else
    why not (see the module docstring); the colwise parents the block calls with their input by
    keyword only (HF attention: ``hidden_states=``)). ``moe_module``: the block's mixture of experts
    (the parent of its experts), whose ``shard_local_modules`` run on the sequence shard and have
    their gradients reduced over the tp ranks too. Never raises: the user's code runs here."""
    keyword: list[str] = []
    try:
        local: tuple[str, ...] = ()
        if moe_module is not None:
            found = shard_local_modules(block, styles, moe_module)
            if isinstance(found, str):
                return found, ()
            local = found
        return _check(block, styles, fused, local_attrs, run, keyword, local, flow), tuple(keyword)
    except Exception as exc:  # noqa: BLE001 - the user's block code, on meta and CPU
        why = f"the sequence-parallel check of block 0 failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return why, tuple(keyword)


def _check(block: nn.Module, styles: Mapping[str, str], fused: Mapping[str, int], local_attrs: tuple[str, ...],
           run: Callable[[], Any], keyword: list[str], local: tuple[str, ...] = (),
           flow: ReplicatedFlow | None = None) -> str | None:
    cols = [n for n, s in styles.items() if s == "colwise"]
    parents = sorted({_parent(c) for c in cols if _parent(c)})
    called: dict[str, bool] = {}
    captured: list[tuple[tuple, dict]] = []
    handles = [block.register_forward_pre_hook(
        lambda m, a, k: captured.append((a, dict(k))) if not captured else None, with_kwargs=True)]
    by_keyword: list[str] = []
    for n, m in block.named_modules():
        wrapped = flow is None or n in flow.shard_norms(True)  # only these get SequenceParallel
        if n and wrapped and is_norm(m) and not isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            handles.append(m.register_forward_pre_hook(
                lambda m, a, k, n=n: by_keyword.append(n) if not (a and isinstance(a[0], torch.Tensor)) else None,
                with_kwargs=True))
    for p in parents:
        def hook(m: nn.Module, a: tuple, k: dict, name: str = p) -> None:
            if name not in called and not (a and isinstance(a[0], torch.Tensor)):
                keyword.append(name)
            called[name] = called.get(name, False) or _map_first(m, a, k, lambda t: t) is not None
        handles.append(block.get_submodule(p).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    why = _stray_parameter(block, styles, local, flow)
    if why:
        return why
    if by_keyword:  # SequenceParallel wraps a norm's first positional input only
        return (f"{by_keyword[0]} (replicated under sequence parallelism, as a norm) is called without a "
                "positional hidden-state input to take as the sequence shard")
    direct = [c for c in cols if not _parent(c)]
    if direct:
        return (f"{direct[0]} sits directly in the block: sequence parallelism all-gathers the input of a "
                "colwise layer's parent module, and the block itself receives the sequence shard")
    for p in parents:
        if p not in called:
            of = next(c for c in cols if _parent(c) == p)
            return (f"{p} (the parent of colwise {of}) is never called (the block calls its layers directly): "
                    "sequence parallelism has no module input there to all-gather")
        if not called[p]:
            return f"{p} is called without a tensor input to all-gather over the sequence"
    if not captured:
        return "block 0 was never called"
    args, kwargs = captured[0]
    n_params = sum(p.numel() for p in block.parameters())
    n_in = sum(t.numel() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
    if n_params > _MAX_CHECK_PARAMS or n_in > _MAX_CHECK_INPUT:
        return None  # too large to run on CPU here: steps 1 and 2 stand alone
    return _numeric(block, styles, fused, local_attrs, parents, args, kwargs)


def _numeric(block: nn.Module, styles: Mapping[str, str], fused: Mapping[str, int], local_attrs: tuple[str, ...],
             parents: list[str], args: tuple, kwargs: dict) -> str | None:
    gen = torch.Generator().manual_seed(0)
    # float64, but where the block holds weights stacked per expert: torch's grouped GEMM (HF's
    # stacked experts) takes no float64, so float32 and a tolerance float32 can keep
    stacked = any(p.dim() >= 3 for p in block.parameters())
    dtype, rtol = (torch.float32, _RTOL_FP32) if stacked else (torch.float64, _RTOL)
    full = _materialise(block, gen, dtype)
    args, kwargs = _real((args, kwargs), gen, dtype)
    hidden = _map_first(full, args, kwargs, lambda t: t)
    x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get(_first_param(full) or "")
    if hidden is None or x is None or x.dim() < 2 or x.shape[1] % _TP:
        return "the block's hidden-state input has no sequence dim (dim 1) that splits in 2"
    want = _first_tensor(full(*args, **kwargs))
    want = want.detach() if want is not None else None
    if want is None or not torch.isfinite(want).all():
        return None  # nothing finite to compare: steps 1 and 2 stand alone
    ranks = [_rank_copy(full, dict(styles), dict(fused), local_attrs, r, _TP) for r in range(_TP)]
    barrier = threading.Barrier(_TP, timeout=120)
    slots: list[Any] = [None] * _TP
    results: list[Any] = [None] * _TP

    def exchange(rank: int, t: torch.Tensor, combine: Callable[[list], torch.Tensor]) -> torch.Tensor:
        slots[rank] = t
        barrier.wait()
        out = combine(list(slots))
        barrier.wait()
        return out

    def gather(rank: int) -> Callable:
        def hook(m: nn.Module, a: tuple, k: dict) -> tuple[tuple, dict]:
            return _map_first(m, a, k, lambda t: exchange(rank, t, lambda s: torch.cat(s, dim=1)))
        return hook

    def reduce_scatter(rank: int) -> Callable:
        def hook(m: nn.Module, a: tuple, out: torch.Tensor) -> torch.Tensor:
            return exchange(rank, out, lambda s: sum(s).chunk(_TP, dim=1)[rank])
        return hook

    for r, m in enumerate(ranks):
        for p in parents:
            m.get_submodule(p).register_forward_pre_hook(gather(r), with_kwargs=True)
        for name, style in styles.items():
            if style == "rowwise":
                m.get_submodule(name).register_forward_hook(reduce_scatter(r))

    def work(r: int) -> None:
        try:
            a, k = _map_first(ranks[r], args, kwargs, lambda t: t.chunk(_TP, dim=1)[r])
            results[r] = _first_tensor(ranks[r](*a, **k))
        except Exception as exc:  # noqa: BLE001 - reported below
            results[r] = exc
            barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(_TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, Exception) and not isinstance(r, threading.BrokenBarrierError)]
    if errors:
        e = errors[0]
        return f"the simulated sequence-parallel block failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if any(isinstance(r, Exception) for r in results):
        return "the simulated sequence-parallel block did not finish (its ranks called their layers differently)"
    if any(r is None for r in results):
        return "the simulated sequence-parallel block returned no tensor"
    got = torch.cat([r.detach() for r in results], dim=1)
    if got.shape != want.shape:
        return f"the simulated sequence-parallel block returned shape {tuple(got.shape)}, the full block {tuple(want.shape)}"
    scale = float(want.abs().max()) or 1.0
    err = float((got - want).abs().max()) / scale
    if err > rtol:
        return f"the simulated sequence-parallel block differs from the full block (relative error {err:.1e})"
    return None
