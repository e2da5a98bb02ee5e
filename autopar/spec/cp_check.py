"""Whether anything but the attention carries information along the sequence in a block: what
context parallelism, as the executor runs it on Hugging Face attention, needs.

Context parallelism (executor/parallel/hf_attention.py) hands every cp rank a shard of the sequence
and makes only the attention see the whole prefix; everything else in the block runs on the shard.
That is exact only when nothing else in the block mixes positions. Hybrids break it: Falcon-H1 runs
a Mamba-2 scan beside its attention in every block (its causal conv and scan carry state from one
position to the next), RWKV shifts tokens, a conv position embedding convolves along the sequence.
The zoo's loss comparison does not see it: a freshly initialised Falcon-H1 changes its loss by 5e-6
when its Mamba branch is zeroed, far below the 1e-4 it compares at.

``mixing_outside_attention`` asks the block itself. Block 0's arguments are captured from a meta
forward of a short sequence (the token inputs cut to ``_SEQ`` positions), the block is materialised
on the CPU with its attention replaced by a position-local stand-in (registered through transformers'
attention interface: each position returns its own value vector), and it runs three times: as is,
with the first half of the hidden state perturbed, and with the second half perturbed. With the
attention local, any change of the unperturbed half's output is mixing outside the attention.
A parameter over ``_MAX_DENSE`` elements views shared values (``_materialise``). Needs torch, never torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from autopar.modelfile import call_model
from autopar.spec.meta import tolerant_meta
from autopar.spec.module_copy import copy_module
from autopar.spec.sp_check import _map_first
from autopar.spec.spec_inputs import cut_tokens

_SEQ = 8  # positions of the check's sequence
_MAX_DENSE = 32_000_000  # elements of a parameter given values of its own (fp32: 128 MB); above, shared ones
_MAX_SHARED = 300_000_000  # elements of the buffer larger parameters view (fp32: 1.2 GB); above, one value
_POOL = 1_048_573  # random draws the shared buffer repeats (a prime)
_LOCAL = "autopar_position_local"


def _local_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Each query position gets its own value vector: attention that mixes nothing. q, k, v are
    (batch, heads, seq, head_dim) (key/value heads repeated to the query's), out (batch, seq, heads, dim)."""
    v = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1) if value.shape[1] != query.shape[1] else value
    return v.transpose(1, 2).contiguous(), None


def _real(value: Any, gen: torch.Generator) -> Any:
    def conv(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, generator=gen, dtype=torch.float32)
        if t.dtype == torch.bool:
            return torch.ones(t.shape, dtype=torch.bool)
        return torch.ones(t.shape, dtype=t.dtype)  # masks keep every position; indices stay in range

    return tree_map(conv, value)


def _fill(t: torch.Tensor, gen: torch.Generator, shared: torch.Tensor | None) -> torch.Tensor:
    if not t.is_floating_point():
        return torch.ones(t.shape, dtype=torch.bool) if t.dtype == torch.bool else torch.zeros(t.shape, dtype=t.dtype)
    if t.numel() <= _MAX_DENSE:
        return torch.randn(t.shape, generator=gen) * 0.2
    if shared is not None and t.numel() <= shared.numel():
        return shared[:t.numel()].view(t.shape)  # dense and contiguous, no allocation of its own
    return (torch.randn((), generator=gen) * 0.2).expand(t.shape)  # one value, no storage (see _materialise)


def _tiled(numel: int, gen: torch.Generator) -> torch.Tensor:
    """``numel`` random values at memory-copy speed: a pool of ``_POOL`` normal draws repeated (a
    prime period, so no two rows of a weight wider than one row of the pool repeat each other)."""
    pool = torch.randn(_POOL, generator=gen) * 0.2
    return pool.repeat(-(-numel // _POOL))[:numel]


def _materialise(block: nn.Module, gen: torch.Generator) -> nn.Module:
    """A CPU copy of ``block`` (on meta) in fp32 with random values. A tensor over ``_MAX_DENSE``
    elements -- a large model's MLP and expert weights (Falcon-H1 7B's MLP is 38M, Llama 4's stacked
    experts 1.3B), which act on each position alone -- views one shared buffer of random values the
    size of the largest of them (a linear layer reading a broadcast weight copies it whole on every
    call: 4 of Llama-2 7B's 6 s of measurement); above ``_MAX_SHARED`` elements it holds one random
    value broadcast over its shape (no storage). The mixers a check must see (in-projections, convs,
    scan parameters) stay dense and their own -- one value for a whole mixer weight would make every
    channel equal, and a norm over the channels would then hide what the scan carries."""
    real = copy_module(block)
    tensors = [t for mod in real.modules() for t in (*mod._parameters.values(), *mod._buffers.values())
               if t is not None and t.is_floating_point()]
    big = max((t.numel() for t in tensors if _MAX_DENSE < t.numel() <= _MAX_SHARED), default=0)
    shared = _tiled(big, gen) if big else None
    for mod in real.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = nn.Parameter(_fill(p, gen, shared), requires_grad=False)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = _fill(b, gen, shared)
    return real.eval()


def _first(value: Any) -> torch.Tensor | None:
    return next((t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)), None)


def mixing_outside_attention(model: nn.Module, blocks_path: str, attention: str, inputs: Any) -> str | None:
    """Why block 0 of ``model`` (on meta) is not exact under context parallelism -- it mixes positions
    outside its attention module ``attention`` (block-relative) -- or None (it does not, or the check
    cannot run here). Never raises: the user's code runs here."""
    try:
        return _check(model, blocks_path, attention, inputs)
    except Exception:  # noqa: BLE001 - the user's block on CPU: no answer rather than a wrong one
        return None


def _check(model: nn.Module, blocks_path: str, attention: str, inputs: Any) -> str | None:
    from transformers import AttentionInterface

    block = model.get_submodule(blocks_path)[0]
    captured: list[tuple[tuple, dict]] = []
    handle = block.register_forward_pre_hook(
        lambda m, a, k: captured.append((a, dict(k))) if not captured else None, with_kwargs=True)
    try:
        with torch.no_grad(), tolerant_meta():
            short = cut_tokens(inputs, _SEQ)
            call_model(model, inputs if short is None else short)
    finally:
        handle.remove()
    if not captured:
        return None
    gen = torch.Generator().manual_seed(0)
    real = _materialise(block, gen)
    AttentionInterface.register(_LOCAL, _local_attention)
    cfg = getattr(real.get_submodule(attention), "config", None)
    if cfg is None:
        return None
    cfg._attn_implementation = _LOCAL  # the copy's config (deepcopy): the model's own is untouched
    args, kwargs = _real(captured[0], gen)
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if x is None:
        first = _map_first(real, args, kwargs, lambda t: t)
        x = None if first is None else _first(first)
    if x is None or x.dim() < 2 or x.shape[1] < 2:
        return None
    half = x.shape[1] // 2

    def out(perturb: slice | None) -> torch.Tensor | None:
        def edit(t: torch.Tensor) -> torch.Tensor:
            if perturb is None:
                return t
            t = t.clone()
            t[:, perturb] += torch.randn(t[:, perturb].shape, generator=gen)
            return t
        mapped = _map_first(real, args, kwargs, edit)
        if mapped is None:
            return None
        with torch.no_grad():
            y = _first(real(*mapped[0], **mapped[1]))
        return y if y is not None and y.shape[:2] == x.shape[:2] else None

    base, first_changed, second_changed = out(None), out(slice(0, half)), out(slice(half, None))
    if base is None or first_changed is None or second_changed is None:
        return None
    tol = 1e-5 * float(base.abs().max()) + 1e-6
    if (first_changed[:, half:] - base[:, half:]).abs().max() > tol or \
            (second_changed[:, :half] - base[:, :half]).abs().max() > tol:
        return (f"block 0 mixes positions outside its attention ({attention}): with the attention made "
                "position-local, changing one half of the sequence changes the other half's output (a scan, "
                "a convolution or a token shift); context parallelism runs all but the attention on a shard")
    return None

