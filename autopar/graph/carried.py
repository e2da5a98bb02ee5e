"""The values a pipeline stage receives beside the hidden state, measured on meta.

A prologue module whose output reaches the blocks other than through the hidden state (an
encoder's output every decoder block attends to, a bias passed as a keyword argument) or that the
epilogue reads (CLIP's first tower) is *carried*: the first stage computes it once and every stage
hands it on after the hidden state (executor/parallel/pipeline_parallel.py). Which modules are
carried is the executor's own rule (``spec.pipeline_probe.probe_structure``), run here on the
one-block model at the shapes the graph is traced at; each carried tensor's bytes are fitted in
the micro-batch and the sequence like any other quantity (graph/scaling.py): an encoder output
scales with its own input's length, a pooled tower with the batch only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from autopar.graph.scaling import FitQuantity, _exps
from autopar.spec.model_spec import ModelSpec
from autopar.spec.pipeline_probe import Probe, probe_structure


def _leaf_bytes(probe: Probe) -> list[tuple[str, float]]:
    """(name, bytes) of every tensor leaf of every carried module's output, in the order the
    executor sends them (module order of ``Probe.carried``, then pytree order)."""
    out = []
    for name in probe.carried:
        template = probe.prologue[name][0]
        tensors = [v for v, t in zip(template.leaves, template.is_tensor) if t]
        for i, (shape, dtype) in enumerate(tensors):
            nbytes = float(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
            out.append((f"{name}[{i}]" if len(tensors) > 1 else name, nbytes))
    return out


def measure_carried(model: nn.Module, spec: ModelSpec, base: Any, batch2: Any,
                    half_seq: Any | None) -> tuple[FitQuantity, ...]:
    """The carried tensors of ``model`` (the one-block model, in the training dtype) as quantities:
    bytes of one sample at the base inputs ``base`` (micro-batch 1, the graph's sequence), with
    exponents fitted against ``batch2`` (micro-batch 2) and ``half_seq`` (half the sequence; None:
    not a sequence model, exponent 0). Empty when nothing is carried -- then only one meta forward
    ran. The probe at the other shapes must find the same tensors; where it does not (a carried
    value whose structure changes with the shape), a tensor without a counterpart keeps exponent
    1 in the batch and 0 in the sequence."""
    at_base = _leaf_bytes(probe_structure(model, spec, base))
    if not at_base:
        return ()
    at_b2 = dict(_leaf_bytes(probe_structure(model, spec, batch2)))
    at_half = dict(_leaf_bytes(probe_structure(model, spec, half_seq))) if half_seq is not None else {}
    return tuple(FitQuantity(what=name, phase="fwd", nbytes=nbytes,
                             exps=_exps(nbytes, at_b2.get(name), at_half.get(name), None))
                 for name, nbytes in at_base)
