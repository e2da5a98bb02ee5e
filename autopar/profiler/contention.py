"""How a CPU rank slows down as more ranks share the machine: the contention curve of a profile.

The layer tables are measured as one of ``--load-ranks`` ranks (autopar.profiler.load). A plan may
run another number of ranks on the same machine; rather than one table per rank count, the
profiler times one reference -- the model file's one-block model, forward and backward at the
largest profiled micro-batch, on one thread -- beside 0, 1, 3, 7, ... helpers (R = 1, 2, 4, 8, ...
up to twice the cores, and the table's own R), on the thread's CPU time times max(1, R / cores):
each rank's fair share of a core beyond the cores, and below them the cycles the shared caches and
memory bandwidth cost -- but not the waits for other work on a shared machine, which wall time
would fold in (a curve taken at load average 10 on 2 cores ran 1 rank slower than 4). The
curve goes into ``measured.device.contention`` as ``[[ranks, seconds], ...]``;
autopar.profile_conditions rescales the profile's compute (and its collectives) by
curve(R_run) / curve(R_profile).

Helpers are added level by level and the timing starts only when every helper runs its loop
(``wait_ready``), so a level's figure is the reference beside R - 1 ranks that train.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from typing import Callable

import torch

from autopar.modelfile import ModelFile, call_model
from autopar.profiler.cores import usable_cores
from autopar.profiler.load import start_load, stop_load, wait_ready

MAX_RANKS = 16


def curve_ranks(cores: int, table_ranks: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to twice the cores (at most MAX_RANKS), plus the cores and the table's ranks."""
    top = min(MAX_RANKS, max(2, 2 * cores))
    ranks = {1, cores, table_ranks}
    r = 2
    while r <= top:
        ranks.add(r)
        r *= 2
    return tuple(sorted(x for x in ranks if 1 <= x <= max(top, table_ranks)))


def _reference(mf: ModelFile, micro_batch: int, dtype: str) -> Callable[[], None]:
    from autopar.graph.build import one_block_model
    from autopar.profiler.layers import DTYPES, materialise
    from autopar.spec import model_spec

    meta = mf.build("meta")
    model = materialise(one_block_model(meta, model_spec(mf, meta).blocks_path), torch.device("cpu"))
    model.train()
    inputs = mf.example_inputs(micro_batch, "cpu")

    autocast = nullcontext() if dtype == "fp32" else torch.autocast("cpu", dtype=DTYPES[dtype])

    def run() -> None:
        with autocast:
            out = call_model(model, inputs)
            loss = mf.loss_fn(out, inputs) if mf.loss_fn is not None else out.float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
    return run


def measure_contention(mf: ModelFile, micro_batch: int, ranks: tuple[int, ...], *, dtype: str = "fp32", repeats: int = 7,
                       log: Callable[[str], None] | None = None) -> list[list[float]]:
    """``[[R, seconds], ...]``: the reference's median time at each R (see the module docstring)."""
    cores = usable_cores()
    run = _reference(mf, micro_batch, dtype)
    for _ in range(2):
        run()
    helpers: list = []
    curve: list[list[float]] = []
    try:
        for r in sorted(ranks):
            more = start_load(r - 1 - len(helpers), "cpu", str(mf.path), micro_batch)
            wait_ready(more)
            helpers += more
            share = max(1.0, r / cores)
            times = []
            for _ in range(max(15, repeats)):  # a block of a few ms: more samples than a layer point
                t0 = time.thread_time()
                run()
                times.append((time.thread_time() - t0) * share)
            curve.append([r, statistics.median(times)])
            if log is not None:
                log(f"contention: {r} rank(s) on {cores} cores: reference block {curve[-1][1] * 1e3:.2f} ms")
    finally:
        stop_load(helpers)
    return curve
