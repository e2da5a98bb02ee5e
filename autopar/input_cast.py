"""A weight's own dtype for what enters it: 16-bit training of models that make fp32 features.

Many model files compute part of their forward in fp32 on purpose -- a diffusion model's sinusoidal
timestep features (``t.float() * freqs``), a rotary table, an fp32 norm -- and feed the result to a
Linear. Under ``torch.autocast`` (how such code is usually trained, and how ``autopar run`` trains DDP
and one-rank plans) the Linear casts its input to 16 bits. Under FSDP2's mixed-precision policy (ZeRO,
and every tensor- or pipeline-parallel plan) there is no autocast: the parameters are 16-bit, and
``F.linear(fp32 input, bf16 weight)`` fails with "mat1 and mat2 must have the same dtype" on CPU and
CUDA alike (meta and fake tensors do not check: the trace and the rehearsal went on in fp32). DiT-XL/2
failed at its first step.

``cast_wider_inputs`` gives every GEMM-like leaf module (``nn.Linear``, convolutions, Hugging Face's
``Conv1D``) a forward pre-hook that casts a floating input *wider* than its weight to the weight's
dtype -- the cast autocast makes for these ops -- and leaves every other input alone. It never
widens: under autocast the weights are fp32 and nothing is wider, in fp32 plans nothing is either, so
the hook only acts where the call would otherwise fail. Installed at build (``ModelFile.build``), so
the planner's trace, the rehearsal, the profiler and the executor run the same forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_ATTR = "_autopar_input_cast"  # set on a module once hooked: a model built twice is hooked once


def gemm_like(mod: nn.Module) -> bool:
    """Whether ``mod`` computes a GEMM or convolution of its input with its own floating ``weight``."""
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() < 2:
        return False
    return isinstance(mod, (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)) or type(mod).__name__ == "Conv1D"


def _narrowed(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype.itemsize > dtype.itemsize:
        return x.to(dtype)
    return x


def _pre_hook(mod: nn.Module, args: tuple) -> tuple | None:
    w = mod.weight
    if not w.is_floating_point() or not args:
        return None
    cast = tuple(_narrowed(a, w.dtype) for a in args)
    return cast if any(c is not a for c, a in zip(cast, args)) else None


def cast_wider_inputs(model: nn.Module) -> int:
    """Hook every GEMM-like module of ``model`` (module docstring); returns how many were hooked now."""
    count = 0
    for mod in model.modules():
        if gemm_like(mod) and not getattr(mod, _ATTR, False):
            mod.register_forward_pre_hook(_pre_hook)
            object.__setattr__(mod, _ATTR, True)
            count += 1
    return count

