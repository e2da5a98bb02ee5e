"""A batch as the model file gives it (a tensor, or tuples, lists and dicts of them): its rows and
its device. Used by the training loop (executor/runtime/train.py) and the pipeline's loss (executor/
pipeline_parallel.py), which therefore need not import each other.
"""

from __future__ import annotations

from typing import Any

import torch


def rows(x: Any, start: int, end: int) -> Any:
    """Rows [start, end) of every tensor in a batch (dim 0 is the sample dimension)."""
    if isinstance(x, torch.Tensor):
        return x[start:end]
    if isinstance(x, (tuple, list)):
        return type(x)(rows(v, start, end) for v in x)
    if isinstance(x, dict):
        return {k: rows(v, start, end) for k, v in x.items()}
    return x


def to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x
