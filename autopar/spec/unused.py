"""Parameters that the training loss never reaches: found on the meta device, for data parallelism.

Models carry parameters their training forward does not use: DINOv2's ``mask_token`` (read only when
a masked-image batch is passed), a pooler beside a token-level loss, a second head. One rank's
optimizer skips them (their ``.grad`` stays None). DDP does not: its reducer waits for every
parameter's gradient before it all-reduces a bucket, so a bucket holding an unused parameter never
reduces -- the other gradients are never averaged over the ranks, and the next step stops with
"Expected to have finished reduction". DDP follows such parameters only when told
(``find_unused_parameters=True``, a walk of the autograd graph every step), so the executor tells it
exactly when this module finds some: one forward, ``loss_fn`` and an autograd pass on meta
(``torch.autograd.grad(..., allow_unused=True)``: None for a parameter the loss does not depend on).
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.modelfile import ModelFile, call_model
from autopar.spec.meta import tolerant_meta


def parameters_without_grad(mf: ModelFile, micro_batch_size: int = 1) -> tuple[str, ...]:
    """Names of the trainable parameters of ``mf``'s model that its ``loss_fn`` does not reach
    (empty when the file has no ``loss_fn``: the executor refuses to train it anyway)."""
    if mf.loss_fn is None:
        return ()
    model = mf.build("meta")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        return ()
    inputs = mf.example_inputs(micro_batch_size, "meta")
    with tolerant_meta():
        loss: Any = mf.loss_fn(call_model(model, inputs), inputs)
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return ()
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return tuple(n for (n, _), g in zip(named, grads) if g is None)
