"""``--load-ranks N``: the other ranks of a CPU run, as helper processes beside the profiler.

A run with more single-threaded ranks than cores shares each core between ranks, and every rank
runs the same model: they compete for the cores and for the caches and memory bandwidth the
model's weights and activations pass through. The helpers reproduce that: each trains the model
file's one-block model (the profiler's own, ``one_block_model``) forward and backward in a loop at
the largest profiled micro-batch, on one thread, until stopped. A helper whose model cannot be
built or run for a reason of autopar's falls back to a GEMM loop of similar size, so the cores are
never left idle.

Run as ``python -m autopar.profiler.load MODEL.py MICRO_BATCH``; ``start_load`` / ``stop_load``
manage them. A helper prints one line (``READY``) when its loop starts; ``wait_ready`` waits for it,
so that what is timed next runs beside helpers that train, not beside helpers importing torch.

A failure of the user's model in a helper (its model file's code, or its model's forward, loss or
backward: autopar.usercode.raised_by_model) is the profile's failure: a profile timed beside a
helper that stopped training would be wrong. The helper prints ``error <line>`` -- the one line the
profiler would print for it -- instead of, or after, ``READY`` and exits with code 2; ``wait_ready``
(before the loop started) and ``check_load`` (once timing is done) raise it in the profiler as a
``ModelFileError``. The model's own prints go to the helper's stderr (discarded), never into the
line pipe: a full pipe would block the helper.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from autopar.modelfile import ModelFile

READY = "ready"
ERROR = "error "  # + the one line of the model's failure (a ModelFileError's message)


def start_load(n: int, device_type: str, model_path: str, micro_batch: int) -> list[subprocess.Popen]:
    """``n`` single-threaded helper processes (CPU only): the other ranks a run would have."""
    if n <= 0 or device_type != "cpu":
        return []
    cmd = [sys.executable, "-m", "autopar.profiler.load", str(model_path), str(micro_batch)]
    return [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(n)]


def wait_ready(procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    """Wait until every helper has started its loop (or died, or ``timeout_s`` passed). Raises the
    ``ModelFileError`` of a helper whose model failed before its loop (module docstring)."""
    deadline = time.monotonic() + timeout_s
    waiting = [p for p in procs if p.stdout is not None]
    failed: list[str] = []
    while waiting and time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout for p in waiting], [], [], max(0.0, deadline - time.monotonic()))
        for p in [q for q in waiting if q.stdout in ready]:
            line = p.stdout.readline()  # the READY line, an error line, or "" when it died
            if line.startswith(ERROR):
                failed.append(line[len(ERROR):].strip())
            waiting.remove(p)
    _raise_first(failed)


def check_load(procs: list[subprocess.Popen]) -> None:
    """Raise the ``ModelFileError`` of a helper whose model failed in its loop (it has exited, its
    error line in the pipe); helpers still running, or that died without a line, pass."""
    failed = []
    for p in procs:
        if p.stdout is not None and not p.stdout.closed and p.poll() is not None:
            failed += [line[len(ERROR):].strip() for line in p.stdout.read().splitlines() if line.startswith(ERROR)]
    _raise_first(failed)


def _raise_first(failed: list[str]) -> None:
    if failed:
        from autopar.errors import ModelFileError

        raise ModelFileError(failed[0])


def stop_load(procs: list[subprocess.Popen]) -> None:
    """Stop every helper (SIGTERM, SIGKILL after 10 s) and wait for it: none is left behind."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


def _gemm_loop(report: TextIO) -> None:
    import torch

    x, w = torch.randn(4, 128, 256), torch.randn(256, 1024)
    _ready(report)
    while True:
        torch.nn.functional.gelu(x @ w).sum()


def _model_loop(mf: ModelFile, micro_batch: int, report: TextIO) -> None:
    import torch

    from autopar.modelfile import backward, call_model
    from autopar.profiler.layers import block_model, materialise

    meta = mf.build("meta")
    try:
        from autopar.spec import model_spec

        blocks_path: str | None = model_spec(mf, meta).blocks_path
    except Exception:  # noqa: BLE001 - the load must go on (see main): the whole model then
        blocks_path = None
    with mf.running("while building the block on cpu"):  # its reset_parameters
        model = materialise(block_model(mf, meta, blocks_path), torch.device("cpu"),
                            mf.buffer_values())
    model.train()
    inputs = mf.example_inputs(micro_batch, "cpu")
    _ready(report)
    with mf.running(f"while training the block alongside the profiler (a helper rank) at micro-batch {micro_batch} "
                    "on cpu"):
        while True:
            out = call_model(model, inputs)
            loss = mf.loss_fn(out, inputs) if mf.loss_fn is not None else out.float().mean()
            backward(loss)
            model.zero_grad(set_to_none=True)


def _ready(report: TextIO) -> None:
    _say(report, READY)


def _say(report: TextIO, line: str) -> None:
    try:
        print(line, file=report, flush=True)
    except (OSError, ValueError):  # the profiler is gone: nobody to tell
        pass


def _line_pipe() -> TextIO:
    """The pipe to the profiler (fd 1 as started), for ``READY`` and error lines only: fd 1 and
    ``sys.stdout`` then point at stderr, so that the model's prints never fill the pipe."""
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return report


def main(argv: list[str]) -> None:
    import torch

    from autopar.errors import ModelFileError
    from autopar.modelfile import load_model_file

    torch.set_num_threads(1)
    report = _line_pipe()
    try:
        _model_loop(load_model_file(argv[0]), int(argv[1]), report)
    except ModelFileError as exc:  # the user's model failed: the profile's failure (module docstring)
        _say(report, f"{ERROR}{exc}")
        report.close()
        os._exit(2)
    except Exception:  # noqa: BLE001 - autopar's own trouble: the load goes on, a busy core all the same
        _gemm_loop(report)


if __name__ == "__main__":
    main(sys.argv[1:])
