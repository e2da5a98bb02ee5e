"""Ops that PyTorch gives no meta kernel: their output shapes, from their shape rules or from the
CPU kernel on stand-in values.

A few aten ops have CPU and CUDA kernels but no meta (fake) implementation -- the CTC loss
(``_ctc_loss`` and its backward, HF Wav2Vec2ForCTC's loss) is one -- so a forward on meta stops
there with ``NotImplementedError``, although the op is ordinary at run time. What a meta run needs
from such an op is its outputs' shapes and dtypes. An op whose inputs' values must agree with each
other (the CTC loss: the target lengths sum to the targets) has its shape rule here (``_RULES``);
any other runs its CPU kernel on zero-filled tensors of the inputs' shapes and dtypes and returns meta tensors of what it gave. Zeros
are the neutral stand-in (lengths 0, indices 0, probabilities log 0 = -inf never read): an op whose
output shape follows its input values (the CTC loss's alpha table is as wide as the longest target)
is measured at its smallest. The inputs are capped in size, so a large op never runs on the CPU; an
op over the cap, or one the zeros make fail, keeps the original error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

MAX_INPUT_BYTES = 256 * 2**20  # the stand-in inputs of one call, at most


def _zeros_like_meta(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and a.is_meta:
        return torch.zeros(a.shape, dtype=a.dtype, device="cpu")
    return a


def _as_meta(r: Any) -> Any:
    return torch.empty(r.shape, dtype=r.dtype, device="meta") if isinstance(r, torch.Tensor) else r


def _ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, *rest: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(negative log-likelihood per sample, alpha table (batch, time, 2 x target length + 1)); the
    target length is the padded width of 2-d targets, the mean length of concatenated 1-d ones."""
    batched = log_probs.dim() == 3
    batch = log_probs.shape[1] if batched else 1
    width = targets.shape[-1] if targets.dim() == 2 else targets.numel() // max(batch, 1)
    nll = torch.empty((batch,) if batched else (), dtype=log_probs.dtype, device="meta")
    alpha = torch.empty((batch, log_probs.shape[0], 2 * width + 1), dtype=log_probs.dtype, device="meta")
    return nll, alpha


def _ctc_loss_backward(grad: torch.Tensor, log_probs: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(log_probs.shape, dtype=log_probs.dtype, device="meta")


_RULES = {"_ctc_loss": _ctc_loss, "_ctc_loss_backward": _ctc_loss_backward}


def run_for_shapes(func: Any, args: tuple, kwargs: dict) -> Any | None:
    """Meta tensors of the shapes and dtypes ``func`` returns: by its rule, else on zero stand-ins;
    None where it cannot say (inputs over the cap, an input on or an output to a real device, the CPU
    kernel failing)."""
    rule = _RULES.get(func._overloadpacket.__name__)
    if rule is not None:
        return rule(*args, **kwargs)
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if not tensors or any(not t.is_meta for t in tensors):
        return None
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "meta":
        return None  # a copy to a real device: the model goes on with its values, which meta has none of
    if sum(t.numel() * t.element_size() for t in tensors) > MAX_INPUT_BYTES:
        return None
    try:
        with torch.no_grad():
            got = func(*tree_map(_zeros_like_meta, args), **tree_map(_zeros_like_meta, kwargs))
    except Exception:  # noqa: BLE001 - the zeros are not inputs this op takes: the meta error stands
        return None
    return tree_map(_as_meta, got)
