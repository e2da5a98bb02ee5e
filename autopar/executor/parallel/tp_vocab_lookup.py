"""The vocab-parallel embedding's lookup on each rank's own rows (Megatron-LM's
``VocabParallelEmbedding``), under DTensor's ``RowwiseParallel``.

``RowwiseParallel`` shards an ``nn.Embedding``'s weight by rows (Shard(0)) and DTensor runs the
lookup as a masked partial sum, which is right forward. Backward it is not what a vocab-parallel
embedding should be: DTensor has no row-sharded strategy for ``embedding_dense_backward``
(torch 2.13, ``_embedding_ops.py``), so with a replicated output gradient it computes the weight's
gradient replicated -- the *whole* vocabulary on every tp rank -- and then keeps the rank's rows.
At GPT-3's 50 k x 12 288 that is 1.15 GiB in bf16 plus its fp32 copy in the data-parallel wrap's
reduce dtype, 3.5 GiB on the first pipeline stage during the embedding's backward, whatever tp is
(rehearsed: GPT-3's Megatron layout at tp 8 peaked there); Llama 3's 128 k vocabulary doubles it.

Here the lookup runs on local tensors: each rank looks up the ids that fall in its rows (the
others read row 0 and are zeroed), its output is the Partial sum DTensor ``RowwiseParallel``'s
output layout all-reduces (or reduce-scatters) as before, and autograd's backward of the local
``F.embedding`` writes the rank's rows only, returned through ``DTensor.to_local`` as the
parameter's Shard(0) gradient -- no whole-vocabulary tensor, no communication.

The lookup sits under the module's own ``forward``: a model's embedding subclass that scales or
adds to the lookup (Gemma's scaled embedding) keeps its code and calls this through ``super()``.
Embeddings using ``max_norm`` (renormalises rows in place), ``scale_grad_by_freq`` (counts ids,
which the masked ids would skew) or sparse gradients keep DTensor's lookup.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard


class _LocalRowsLookup(nn.Embedding):
    """``nn.Embedding.forward`` on this rank's rows of a Shard(0) weight (module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Embedding's signature
        weight = self.weight
        if not isinstance(weight, DTensor) or tuple(weight.placements) != (Shard(0),) or weight.device_mesh.ndim != 1:
            return super().forward(input)
        mesh = weight.device_mesh
        ids = input.to_local() if isinstance(input, DTensor) else input
        local = weight.to_local()  # backward: the gradient of the rank's rows, as a Shard(0) DTensor
        rows = local.shape[0]
        start = mesh.get_local_rank() * rows
        shifted = ids - start
        outside = (shifted < 0) | (shifted >= rows)
        pad = self.padding_idx
        pad = pad - start if pad is not None and start <= pad < start + rows else None
        out = F.embedding(shifted.masked_fill(outside, 0), local, pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return DTensor.from_local(out, mesh, [Partial()], run_check=False)


def install(module: nn.Module) -> bool:
    """Give ``module`` (an ``nn.Embedding`` already parallelized with ``RowwiseParallel``) the
    local-rows lookup under its own forward; False (left as it is) where the embedding's options
    need DTensor's (module docstring). The class is swapped in place, as FSDP2 does, so names,
    parameters and hooks stay."""
    if not isinstance(module, nn.Embedding) or isinstance(module, _LocalRowsLookup):
        return False
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        return False
    cls = type(module)
    # The lookup goes right above nn.Embedding in the method order, under any subclass's forward
    bases = (_LocalRowsLookup,) if cls is nn.Embedding else (cls, _LocalRowsLookup)
    module.__class__ = type(f"VocabParallel{cls.__name__}", bases, {})
    return True
