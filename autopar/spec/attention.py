"""Attention that Hugging Face transformers dispatches through its attention interface.

transformers 5 selects a block's attention function with ``ALL_ATTENTION_FUNCTIONS`` keyed by
``config._attn_implementation`` ("sdpa", "eager", ...); the intended way to change attention is to
register an implementation (``AttentionInterface.register``). ``hf_attention`` finds the block's
module that makes that call and the facts the executor's registered implementation needs
(executor/parallel/hf_attention.py: selective recompute and context parallelism). Needs torch, never
torch.distributed.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True, kw_only=True)
class HFAttention:
    """The attention of a block that dispatches through transformers' attention interface.

    ``module``: its block-relative name (HF: ``self_attn``); ``implementation``: the config's
    ``_attn_implementation``; ``causal``: the module's ``is_causal``; ``sliding_window``: the narrowest
    window or chunk in tokens that any layer of the model attends within (None: full causal
    everywhere); ``dropout``: the attention dropout probability in training;
    ``position_ids``: whether the model's forward takes ``position_ids=`` (where a context-parallel
    shard says where its tokens sit).
    """

    module: str
    implementation: str
    causal: bool
    sliding_window: int | None
    dropout: float
    position_ids: bool

    def __post_init__(self) -> None:
        if not self.implementation:
            raise ValueError("HFAttention.implementation must be a non-empty name")
        if not 0.0 <= self.dropout <= 1.0:
            raise ValueError(f"HFAttention.dropout must be in [0, 1], got {self.dropout}")


def _dispatches(mod: nn.Module) -> bool:
    """Whether ``mod``'s class is an attention whose source module uses the attention interface."""
    source = sys.modules.get(type(mod).__module__)
    return (type(mod).__name__.endswith("Attention") and source is not None
            and "ALL_ATTENTION_FUNCTIONS" in vars(source))


def _window(mod: nn.Module, cfg: Any, seq_len: int | None = None) -> int | None:
    """The narrowest window in tokens that any of the model's attention layers uses, None when every
    layer attends to the whole prefix (context parallelism here is exact only then, whichever layer
    the probed block is) -- also when no window is shorter than ``seq_len``, the model file's
    SEQ_LEN, the longest sequence a plan may train at (Llama 4 Scout's chunks of 8192 at 4096
    tokens). The module's own attribute where it has one (Qwen2: None on full-attention layers); else
    the config's, unless the config says the window is off (``use_sliding_window=False``) or assigns
    windows per layer. Per-layer assignments (``layer_types``) count for every layer: a sliding layer
    anywhere has ``sliding_window`` tokens, a chunked one (Llama 4) attends within chunks of
    ``attention_chunk_size``. A window of 0 or less is no window."""
    if hasattr(mod, "sliding_window"):
        windows = [mod.sliding_window]
    elif getattr(cfg, "use_sliding_window", True) is False or getattr(cfg, "layer_types", None):
        windows = []
    else:
        windows = [getattr(cfg, "sliding_window", None)]
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if kinds & _SLIDING_LAYERS and getattr(cfg, "use_sliding_window", True) is not False:
        windows.append(getattr(cfg, "sliding_window", None))
    if kinds & _CHUNKED_LAYERS:
        windows.append(getattr(cfg, "attention_chunk_size", None))
    sizes = [w for w in windows if isinstance(w, int) and not isinstance(w, bool) and w > 0
             and (seq_len is None or w < seq_len)]
    return min(sizes, default=None)


# transformers' layer_types values of layers that attend within a window or a chunk, not the whole prefix
_SLIDING_LAYERS = {"sliding_attention", "reference_sliding_attention", "window_attention"}
_CHUNKED_LAYERS = {"chunked_attention"}


def hf_attention(model: nn.Module, block: nn.Module, seq_len: int | None = None) -> HFAttention | None:
    """The block's interface-dispatched attention (the outermost one), or None; ``seq_len``: the
    model file's SEQ_LEN (a window no shorter is no window)."""
    for name, mod in block.named_modules():
        cfg = getattr(mod, "config", None)
        impl = getattr(cfg, "_attn_implementation", None)
        if not name or not isinstance(impl, str) or not _dispatches(mod):
            continue
        window = _window(mod, cfg, seq_len)
        rates = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
        dropout = next((float(getattr(cfg, a)) for a in rates if isinstance(getattr(cfg, a, None), (int, float))), 0.0)
        try:
            takes_ids = "position_ids" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            takes_ids = False
        return HFAttention(module=name, implementation=impl, causal=bool(getattr(mod, "is_causal", False)),
                           sliding_window=window, dropout=dropout,
                           position_ids=takes_ids)
    return None
