"""One check of a model file's ``example_inputs`` against the contract, before any planning.

The executor and the planner rely on ``example_inputs(b)`` meaning "one micro-batch of b samples":
dim 0 of every tensor is the sample dimension (data parallelism and micro-batching slice it),
the other dimensions and the dtypes do not depend on b, and a sequence model's tokens run along
dim 1 with ``SEQ_LEN`` of them. A model file that breaks this planned fine and then failed, or
silently trained on something else, at run time; ``check_example_inputs`` says so in one line.
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import tree_flatten

from autopar.errors import ModelFileError


def _tensors(value: Any) -> tuple[list[Any], Any]:
    import torch

    leaves, spec = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)], spec


def check_example_inputs(mf: Any) -> None:
    """Raise a one-line ModelFileError unless ``mf.example_inputs`` meets the contract above."""
    one, two = mf.example_inputs(1, "meta"), mf.example_inputs(2, "meta")
    t1, spec1 = _tensors(one)
    t2, spec2 = _tensors(two)
    where = f"{mf.path}: example_inputs"
    if not t1:
        raise ModelFileError(f"{where}(1) returns no tensor; return a tensor, a tuple or a dict of tensors")
    if spec1 != spec2 or len(t1) != len(t2):
        raise ModelFileError(f"{where}(1) and example_inputs(2) return different structures; only the batch size "
                             "may change")
    for i, (a, b) in enumerate(zip(t1, t2)):
        name = f"tensor {i}" if len(t1) > 1 else "the tensor"
        if a.ndim == 0:
            raise ModelFileError(f"{where}: {name} is a scalar; dim 0 must be the sample dimension")
        if a.shape[0] != 1 or b.shape[0] != 2:
            # rows folded into dim 0 (MusicGen's batch x codebooks): say how to unfold them -- autopar
            # splits dim 0 across ranks and micro-batches, and cannot tell sample-major rows from others
            rows = a.shape[0] if a.shape[0] > 1 and b.shape[0] == 2 * a.shape[0] else 0
            fix = (f"; it holds {rows} rows per sample: return them in a dim of their own ({[1, rows, *a.shape[1:]]}) "
                   "and fold them inside the model's forward" if rows else "")
            raise ModelFileError(
                f"{where}: {name} has shape {list(a.shape)} for 1 sample and {list(b.shape)} for 2; dim 0 must be "
                f"the micro-batch size{fix}")
        if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
            raise ModelFileError(f"{where}: {name} changes shape or dtype with the batch size "
                                 f"({list(a.shape)} {a.dtype} vs {list(b.shape)} {b.dtype})")
    seq = mf.seq_len
    if seq is not None and seq > 1 and not any(t.ndim >= 2 and t.shape[1] == seq for t in t1):
        shapes = ", ".join(str(list(t.shape)) for t in t1)
        raise ModelFileError(f"{where}(1) returns shapes {shapes}, none with SEQ_LEN {seq} tokens along dim 1; make "
                             "them agree")
