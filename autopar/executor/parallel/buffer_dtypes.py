"""Floating buffers in the dtype the model's own code gives them when it trains in 16 bits.

Under FSDP2's mixed precision (ZeRO 1-3, and ``replicate`` on pipeline and tensor-parallel parts)
the parameters compute in the training dtype while the buffers stay as the model was built, in
fp32. A model written for one dtype then mixes them: MiniMax's lightning attention multiplies its
bf16 scores by an fp32 decay buffer and hands the (promoted) fp32 product to a matmul with bf16
values, "expected scalar type Float but found BFloat16" at its first step -- on a GPU as on the
rehearsal's fake tensors. Hugging Face's ``from_pretrained(torch_dtype=...)`` builds a model with the
default dtype set to that dtype: a buffer the code makes without naming a dtype (MiniMax's decays, a
sin-cos table) comes out 16-bit, one it makes in fp32 on purpose (a rotary ``inv_freq`` from
``arange(...).float()``) stays fp32. ``built_dtypes`` builds the model on meta that way and
``cast_buffers`` gives each floating buffer of the executor's parts the dtype it has there -- the
16-bit buffers the cost model's trace held (graph/measure.py traces the model in the training dtype).
DDP and a lone rank train under autocast over fp32 parameters, which casts at each op: left as built.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from autopar.modelfile import ModelFile


def built_dtypes(mf: ModelFile, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Full-model name -> dtype of each floating buffer of ``mf``'s model built on meta with the
    default dtype ``dtype``; {} where that build fails (the buffers are then left as built)."""
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        model = mf.build("meta")
    except Exception:  # noqa: BLE001 - the user's code: a model that cannot be built so keeps its buffers
        return {}
    finally:
        torch.set_default_dtype(old)
    return {name: b.dtype for name, b in model.named_buffers() if b.is_floating_point()}


def cast_buffers(part: nn.Module, dtypes: Mapping[str, torch.dtype], full_name: Callable[[str], str]) -> list[str]:
    """Cast each floating buffer of ``part`` to ``dtypes[full_name(name)]`` where it differs (a
    buffer the mapping does not name is left alone); the full names of those cast."""
    cast = []
    for name, buf in list(part.named_buffers()):
        want = dtypes.get(full_name(name))
        if want is None or not buf.is_floating_point() or buf.dtype == want:
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = part.get_submodule(owner_name) if owner_name else part
        owner._buffers[leaf] = buf.to(want)
        cast.append(full_name(name))
    return cast
