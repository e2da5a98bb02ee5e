"""The torch dtype of each training dtype name a plan may give (``plan.DTYPES``): the one map the
graph tracer, the executor and the profiler share. A module of its own because the plan, the
cost model and the search never import torch (a cached graph plans without it)."""

from __future__ import annotations

import torch

__all__ = ["TORCH_DTYPES"]

TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
