"""The inputs the spec's meta forwards run on: the example inputs, or the same tokens cut short when a
forward at full length dispatches too many ops.

Everything the spec reads from a forward on meta -- which modules a block calls and how, the data
flow tensor parallelism pairs, the router, the attention -- is the same at any sequence length. Its
cost is not where the model loops over positions in Python: HF RWKV's reference kernel on CPU and meta
runs a loop over every position in every block, and the spec runs the model a few dozen times (tp
inference checks a pair per forward), so at RWKV-4 7B's 1,024 tokens the spec alone took ~50 s of the
60 s a plan has for tracing. ``spec_inputs`` runs one forward at full length under an op budget;
when it goes past ``SPEC_OP_LIMIT`` ops the spec's forwards take the first ``SHORT_SEQ`` positions of
the token inputs instead (a length chosen to coincide with no usual width: 24). Only token inputs
are cut -- a (batch, seq) integer tensor, or a dict whose ``input_ids`` is one, with the entries of
its shape (labels, attention mask) -- so every input keeps its meaning; others stay as they are.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from autopar.spec.meta import OpBudgetExceeded, op_budget

SPEC_OP_LIMIT = 20_000  # ops of one spec forward (blocks past the first two answered) at full length
SHORT_SEQ = 24


def is_int_matrix(x: Any) -> bool:
    """A (batch, seq) tensor of integers: token ids (not floats, complex numbers or a bool mask)."""
    return (isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() and not x.is_complex()
            and x.dtype != torch.bool)


def cut_tokens(inputs: Any, seq: int) -> Any | None:
    """``inputs`` with its token tensor (and the entries of that shape beside it) cut to the first
    ``seq`` positions; None when the inputs are not tokens or not longer than ``seq``."""
    if is_int_matrix(inputs):
        return inputs[:, :seq] if inputs.shape[1] > seq else None
    if isinstance(inputs, Mapping) and is_int_matrix(inputs.get("input_ids")):
        shape = inputs["input_ids"].shape
        if shape[1] <= seq:
            return None
        return {k: v[:, :seq] if isinstance(v, torch.Tensor) and v.shape == shape else v for k, v in inputs.items()}
    return None


def spec_inputs(inputs: Any, forward: Callable[[Any], Any]) -> Any:
    """``inputs``, or their tokens cut to ``SHORT_SEQ`` when ``forward(inputs)`` (one spec forward on
    meta) dispatches more than ``SPEC_OP_LIMIT`` ops (see the module docstring)."""
    short = cut_tokens(inputs, SHORT_SEQ)
    if short is None:
        return inputs
    with op_budget(SPEC_OP_LIMIT) as budget:
        try:
            forward(inputs)
        except OpBudgetExceeded:
            pass
        except Exception:  # noqa: BLE001 - the forward's own failure is reported by the spec's next forward
            pass
    return short if budget.tripped else inputs
