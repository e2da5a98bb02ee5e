"""The whole model against its layer table: one factor per micro-batch, applied to the table (CPU).

The layer table times one block in a model cut to its first block (autopar.profiler.layers): one
block stands for all. On a CPU that holds less than it should: the whole model's weights and
activations pass through the same caches, so each block of the real model runs slower than the
lone block did, and the more so the smaller the micro-batch (weights are a larger share of what a
small micro-batch touches). Measured on the zoo decoder (4 blocks, 2 M parameters): 1 x 4 rows took
45.5 ms, 2 x 2 rows 53.0 ms, while the table's regions composed to 43.7 and 45.0 ms; the plans
with more micro-batches were priced 20-35 % too fast at 4 ranks.

So the profiler also times the whole model, forward (with the loss) and backward, at each
profiled micro-batch (tp = 1, the full sequence, the same clock, helpers and dtype as the table,
the micro-batches taking turns per round), and divides by what the table composes for it:

    composed(b) = pre(b) + N block(b) + post(b) + loss(b)       (per phase; N the model's blocks)
    factor(b)   = whole(b) / composed(b)

Every point of the table at micro-batch b (every region, tp, cp) is scaled by its phase's
factor(b) (the attention core's forward by the forward's), and the factors are recorded under
``measured.whole_model``. A point at a tp > 1 or cp > 1 gets the factor of its micro-batch: an
approximation (its rank touches 1/tp of the weights). Only on CPU and for a model whose parameters
take at most WHOLE_MAX_PARAM_BYTES: on a GPU weights stream from HBM either way, and a model too big
for the device is what the one-block table is for.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

import torch

from autopar.modelfile import ModelFile, backward, call_model
from autopar.profile_tables import LayerTable

WHOLE_MAX_PARAM_BYTES = 2**30


def whole_model_rows(mf: ModelFile, device: torch.device, table: LayerTable, micro_batches: tuple[int, ...],
                     dtype: str, *, warmup: int, repeats: int,
                     log: Callable[[str], None] | None = None) -> list[dict[str, float]] | None:
    """``[{b, fwd_s, bwd_s, fwd_factor, bwd_factor}, ...]`` (module docstring), or None where the
    whole model is not timed (not CPU, too large, or a table without the tp = 1 points)."""
    from autopar.profiler.layers import _Clock, _inputs, materialise
    from autopar.spec import model_spec
    from autopar.torch_dtypes import TORCH_DTYPES

    if device.type != "cpu":
        return None
    meta = mf.build("meta")
    param_bytes = sum(p.numel() * 4 for p in meta.parameters())
    if param_bytes > WHOLE_MAX_PARAM_BYTES:
        if log:
            log(f"whole model: not timed ({param_bytes / 2**30:.1f} GiB of fp32 parameters)")
        return None
    spec = model_spec(mf, meta)
    num_blocks = len(meta.get_submodule(spec.blocks_path))
    seq = mf.seq_len or 0
    composed = {b: _composed(table, b, seq or 1, num_blocks) for b in micro_batches}
    if any(c is None for c in composed.values()):
        return None
    with mf.running(f"while building the whole model on {device}"):  # its reset_parameters
        model = materialise(meta, device, mf.buffer_values())
    if dtype != "fp32":  # the table's regime: the model cast, no autocast (profiler/layers.py)
        model = model.to(TORCH_DTYPES[dtype])
    model.train()
    inputs = {b: _inputs(mf, b, device, seq, seq, None, TORCH_DTYPES[dtype]) for b in micro_batches}
    samples: dict[int, list[tuple[float, float]]] = {b: [] for b in micro_batches}
    for i in range(warmup + repeats):
        for b in micro_batches:  # in turns, as the table's shapes: a slow spell falls on all alike
            with mf.running(f"while timing the whole model at micro-batch {b} on {device}"):  # one line, exit 2
                times = _one_whole_run(model, inputs[b], mf.loss_fn, _Clock(device))
            if i >= warmup:
                samples[b].append(times)
    rows = []
    for b in micro_batches:
        fwd = statistics.median(t[0] for t in samples[b])
        bwd = statistics.median(t[1] for t in samples[b])
        cf, cb = composed[b]
        rows.append({"b": b, "fwd_s": fwd, "bwd_s": bwd, "fwd_factor": fwd / cf, "bwd_factor": bwd / cb})
        if log:
            log(f"whole model b={b}: fwd {fwd * 1e3:.2f} ms bwd {bwd * 1e3:.2f} ms, x{fwd / cf:.2f} / x{bwd / cb:.2f} "
                f"the table's {num_blocks} blocks and edges")
    return rows


def apply_whole_model(table: LayerTable, rows: list[dict[str, float]]) -> LayerTable:
    """``table`` with every point at a timed micro-batch scaled by that micro-batch's factors."""
    by_b = {int(r["b"]): (float(r["fwd_factor"]), float(r["bwd_factor"])) for r in rows}

    def scaled(p):  # noqa: ANN001, ANN202
        if p.b not in by_b:
            return p
        f, g = by_b[p.b]
        return dataclasses.replace(p, fwd_s=p.fwd_s * f, bwd_s=p.bwd_s * g,
                                   core_fwd_s=None if p.core_fwd_s is None else p.core_fwd_s * f)
    return dataclasses.replace(table, regions={r: tuple(scaled(p) for p in pts) for r, pts in table.regions.items()})


def _composed(table: LayerTable, b: int, s: int, num_blocks: int) -> tuple[float, float] | None:
    fwd = bwd = 0.0
    for region, count in (("pre", 1), ("block", num_blocks), ("post", 1), ("loss", 1)):
        point = next((p for p in table.regions.get(region, ()) if p.b == b and p.s == s and p.tp == 1
                      and p.cp == 1), None)
        if point is None:
            if region == "block":
                return None
            continue
        fwd += count * point.fwd_s
        bwd += count * point.bwd_s
    return (fwd, bwd) if fwd > 0 and bwd > 0 else None


def _one_whole_run(model: torch.nn.Module, inputs: Any, loss_fn: Callable | None,
                   clock: Any) -> tuple[float, float]:
    """(forward with the loss, backward) seconds of one whole-model step, on the table's clock."""
    clock.mark("start")
    out = call_model(model, inputs)
    loss = loss_fn(out, inputs) if loss_fn is not None else out.float().mean()
    clock.mark("fwd")
    backward(loss)
    clock.mark("bwd")
    model.zero_grad(set_to_none=True)
    m = clock.marks
    return m["fwd"] - m["start"], m["bwd"] - m["fwd"]
