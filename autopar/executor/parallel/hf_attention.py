"""Selective recompute and context parallelism on Hugging Face attention, through transformers' own
extension point: a registered attention implementation (``AttentionInterface.register``).

transformers 5 calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)``
with ``(module, query, key, value, attention_mask, dropout=, scaling=, **kwargs)`` on (b, heads, s,
head_dim) tensors after RoPE, and expects ``(output (b, s, heads, head_dim), weights)``. ``install``
registers one implementation per original (``autopar_sdpa``, ``autopar_eager``, ...; for CP,
``autopar_cp``) and points the chunk's configs at it -- the chunk is the executor's deep copy, so
the user's model and the single-process reference keep theirs. What each attention module does is
read from a plain attribute on the module (``_Route``), so one registered function serves every
model in the process:

* selective recompute: the original implementation runs under ``torch.utils.checkpoint``
  (non-reentrant): its s^2 intermediates are recomputed in backward (Korthikanti et al.). The
  attention mask is the original's (the same mask function is registered under the new name);
* context parallelism: ``ContextParallelAttention`` (ring / allgather / ulysses) on the local
  q, k, v, exact for full causal attention from the shard positions; no mask function is
  registered for ``autopar_cp``, so the model builds none (the causal structure comes from the
  positions, which the model also receives as ``position_ids=`` for its rotary tables).

The original "eager" implementation is not in the registry (each model file has its own
``eager_attention_forward``); it is taken from the attention module's source module.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_ATTR = "_autopar_attention"
CP_NAME = "autopar_cp"


@dataclass(frozen=True, kw_only=True)
class _Route:
    original: str
    recompute: bool
    cp: Any = None  # ContextParallelAttention (kept here, not as a submodule: names stay the model's)


def _original(module: nn.Module, name: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"autopar: no attention implementation {name!r} for {type(module).__name__}")
    return eager


def autopar_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The registered implementation (see the module docstring)."""
    route: _Route = getattr(module, _ATTR)
    if route.cp is not None:
        if kwargs.get("dropout", 0.0):
            raise RuntimeError("autopar: context-parallel attention has no dropout; set the attention dropout to 0")
        scale = kwargs.get("scaling")
        if route.recompute:
            out = checkpoint(route.cp, query, key, value, scale=scale, use_reentrant=False)
        else:
            out = route.cp(query, key, value, scale=scale)
        return out.transpose(1, 2).contiguous(), None
    fn = _original(module, route.original)
    if route.recompute:
        return checkpoint(fn, module, query, key, value, attention_mask, use_reentrant=False, **kwargs)
    return fn(module, query, key, value, attention_mask, **kwargs)


def _register(name: str, mask_of: str | None) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, autopar_attention)
    if mask_of is not None and mask_of in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_of])


def install(part: nn.Module, blocks_path: str, module_name: str, *, recompute: bool,
            make_cp: Callable[[], nn.Module] | None = None, recompute_keys: set[str] | None = None) -> int:
    """Route every block's attention ``module_name`` of ``part`` through ``autopar_attention``:
    under checkpoint (``recompute``; with ``recompute_keys``, per-stage recompute, only the blocks of those
    names: every block is routed all the same, since its HF config object is shared) and/or
    context-parallel (``make_cp`` builds one ContextParallelAttention per module).
    Returns the number of modules routed."""
    blocks = part.get_submodule(blocks_path)
    count = 0
    originals: dict[int, str] = {}  # config id -> its implementation before this call (configs are shared)
    for key, block in blocks.named_children():
        if not key.isdigit():
            continue  # pipeline markers
        attn = block.get_submodule(module_name)
        cfg = attn.config
        original = originals.setdefault(id(cfg), cfg._attn_implementation)
        if hasattr(attn, _ATTR):
            original = getattr(attn, _ATTR).original
        name = CP_NAME if make_cp is not None else f"autopar_{original}"
        _register(name, None if make_cp is not None else original)
        setattr(attn, _ATTR, _Route(original=original, recompute=recompute and (recompute_keys is None
                                                                               or key in recompute_keys),
                                               cp=make_cp() if make_cp is not None else None))
        # HF modules share the chunk's one config object (mask creation reads the same one).
        cfg._attn_implementation = name
        count += 1
    return count
