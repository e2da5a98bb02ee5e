"""Autocast for grouped GEMMs: ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` are not
on autocast's lists (pytorch#174763), and torch's CUDA kernels take bf16 only.

A part trained under ``torch.autocast`` keeps fp32 parameters (DDP, a pipeline stage at ZeRO 0-1:
train.py's ``_autocast``). Stacked experts called through a grouped GEMM -- Hugging Face 5's Mixtral,
Qwen-MoE, DeepSeek, gpt-oss, which cast the rows to the weight's dtype first -- then hand the
kernel two fp32 tensors and fail on a GPU ("Expected inputs of BF16 type"), though a CPU run, whose
kernel takes fp32, trains. While autocast is on, this mode casts a grouped GEMM's fp32 operands to
the autocast dtype, as autocast does for ``mm``: the fp32 weights stay the master copy and the
cast's backward returns their gradients in fp32. Active only for a model holding 3-D parameters
(stacked experts; a Conv1d's weight is 3-D too, and such a model pays the hook for nothing), so
other models' forwards pay no per-op Python hook.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_GROUPED = tuple(f for f in (getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None))
                 if f is not None)


class GroupedMMAutocast(TorchFunctionMode):
    """Casts fp32 operands of a grouped GEMM to ``dtype`` while autocast is enabled on ``device_type``."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.device_type, self.dtype = device_type, dtype

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _GROUPED and torch.is_autocast_enabled(self.device_type):
            def cast(v: Any) -> Any:
                return v.to(self.dtype) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def holds_stacked_weights(parts: list[nn.Module]) -> bool:
    """Whether a model part has a parameter of three or more dimensions (weights stacked per expert)."""
    return any(p.dim() >= 3 for part in parts for p in part.parameters())


def with_grouped_autocast(autocast: AbstractContextManager, device_type: str, dtype: torch.dtype,
                          stacked: bool) -> AbstractContextManager:
    """``autocast`` plus ``GroupedMMAutocast`` where the model holds stacked weights and a grouped GEMM exists."""
    if not stacked or not _GROUPED:
        return autocast
    stack = ExitStack()
    stack.enter_context(autocast)
    stack.enter_context(GroupedMMAutocast(device_type, dtype))
    return stack
