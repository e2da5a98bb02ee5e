"""A copy of a module for the spec's probes, whatever state its forward left on it.

The probes (TP inference and its checks, the TP degree check, the CP check) run a copy of a block
so the model itself is never changed. ``copy.deepcopy`` refuses a module that keeps a tensor its
forward computed as a plain attribute -- Hugging Face RecurrentGemma's RG-LRU keeps its recurrent
state (``recurrent_states``), made from the layer's weights, after every forward -- because a tensor
in an autograd graph cannot be deep-copied. Such a tensor is state, not weight: the copy takes it
detached.
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


def copy_module(module: M) -> M:
    """``copy.deepcopy(module)``, with every non-leaf tensor held as a plain module attribute copied
    detached (module docstring)."""
    memo: dict[int, object] = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                memo[id(value)] = value.detach()
    return copy.deepcopy(module, memo)
