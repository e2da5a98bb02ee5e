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

The levels are timed in turns, not one after the other: all helpers of the top level are started
once (the timing begins only when every one runs its loop, ``wait_ready``), and each round times
the reference once per level, the helpers beyond the level paused (SIGSTOP) and the others running
(SIGCONT), the order of the levels reversed every other round. A shared machine's speed moves by
tens of percent over seconds; timed level after level, a slow spell fell on one level and bent the
ratios the run's pricing reads (four profiles of one model minutes apart gave curve(4) / curve(2)
from 1.43 to 2.13). Where processes cannot be paused (no SIGSTOP), levels are timed one after the
other, helpers added level by level.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from contextlib import nullcontext
from typing import Callable

import torch

from autopar.modelfile import ModelFile, backward, call_model
from autopar.profiler.cores import usable_cores
from autopar.profiler.load import check_load, start_load, stop_load, wait_ready

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


def reference_run(mf: ModelFile, micro_batch: int, dtype: str) -> Callable[[], None]:
    from autopar.profiler.layers import materialise, one_block_meta
    from autopar.torch_dtypes import TORCH_DTYPES

    with mf.running("while building the block on cpu"):  # its reset_parameters
        model = materialise(one_block_meta(mf), torch.device("cpu"), mf.buffer_values())
    model.train()
    inputs = mf.example_inputs(micro_batch, "cpu")

    autocast = nullcontext() if dtype == "fp32" else torch.autocast("cpu", dtype=TORCH_DTYPES[dtype])

    def run() -> None:
        with autocast:
            out = call_model(model, inputs)
            loss = mf.loss_fn(out, inputs) if mf.loss_fn is not None else out.float().mean()
        backward(loss)
        model.zero_grad(set_to_none=True)
    return run


def measure_contention(mf: ModelFile, micro_batch: int, ranks: tuple[int, ...], *, dtype: str = "fp32", repeats: int = 7,
                       log: Callable[[str], None] | None = None) -> list[list[float]]:
    """``[[R, seconds], ...]``: the reference's median time at each R (see the module docstring)."""
    cores = usable_cores()
    model_run = reference_run(mf, micro_batch, dtype)

    def run() -> None:  # a failure of the model: one line, exit 2, the helpers stopped (finally below)
        with mf.running(f"while timing the block at micro-batch {micro_batch} on cpu for the contention curve"):
            model_run()

    for _ in range(2):
        run()
    levels = sorted(set(ranks))
    rounds = max(15, repeats)  # a block of a few ms: more samples than a layer point

    samples: dict[int, list[float]] = {r: [] for r in levels}
    helpers: list = []
    try:
        if hasattr(signal, "SIGSTOP"):
            helpers = start_load(levels[-1] - 1, "cpu", str(mf.path), micro_batch)
            wait_ready(helpers)
            for i in range(rounds):
                for r in (levels if i % 2 == 0 else levels[::-1]):
                    _pause_beyond(helpers, r - 1)
                    run()  # one untimed run: the caches settle to this level's sharing
                    samples[r].append(timed_run(run, r, cores))
            check_load(helpers)  # a helper whose model failed: its line, not a curve without its load
        else:
            for r in levels:
                more = start_load(r - 1 - len(helpers), "cpu", str(mf.path), micro_batch)
                wait_ready(more)
                helpers += more
                samples[r] = [timed_run(run, r, cores) for _ in range(rounds)]
            check_load(helpers)
    finally:
        if hasattr(signal, "SIGCONT"):
            _pause_beyond(helpers, len(helpers))  # all running again: a paused process would not take the SIGTERM
        stop_load(helpers)
    curve = [[r, statistics.median(samples[r])] for r in levels]
    if log is not None:
        for r, secs in curve:
            log(f"contention: {r} rank(s) on {cores} cores: reference block {secs * 1e3:.2f} ms")
    return curve


def timed_run(run: Callable[[], None], ranks: int, cores: int) -> float:
    """One run of the reference on the curve's clock: this thread's CPU time times the core share
    of ``ranks`` ranks (module docstring)."""
    t0 = time.thread_time()
    run()
    return (time.thread_time() - t0) * max(1.0, ranks / cores)


def _pause_beyond(helpers: list, running: int) -> None:
    """Helpers ``[:running]`` run, the rest are paused."""
    for i, p in enumerate(helpers):
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT if i < running else signal.SIGSTOP)
