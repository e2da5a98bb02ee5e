"""``--load-ranks N``: the other ranks of a CPU run, as helper processes beside the profiler.

A run with more single-threaded ranks than cores shares each core between ranks, and every rank
runs the same model: they compete for the cores and for the caches and memory bandwidth the
model's weights and activations pass through. The helpers reproduce that: each trains the model
file's one-block model (the profiler's own, ``one_block_model``) forward and backward in a loop at
the largest profiled micro-batch, on one thread, until stopped. A helper that cannot build the
model falls back to a GEMM loop of similar size, so the cores are never left idle.

Run as ``python -m autopar.profiler.load MODEL.py MICRO_BATCH``; ``start_load`` / ``stop_load``
manage them. A helper prints one line (``READY``) when its loop starts; ``wait_ready`` waits for it,
so that what is timed next runs beside helpers that train, not beside helpers importing torch.
"""

from __future__ import annotations

import select
import subprocess
import sys
import time

READY = "ready"


def start_load(n: int, device_type: str, model_path: str, micro_batch: int) -> list[subprocess.Popen]:
    """``n`` single-threaded helper processes (CPU only): the other ranks a run would have."""
    if n <= 0 or device_type != "cpu":
        return []
    cmd = [sys.executable, "-m", "autopar.profiler.load", str(model_path), str(micro_batch)]
    return [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(n)]


def wait_ready(procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    """Wait until every helper has started its loop (or died, or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    waiting = [p for p in procs if p.stdout is not None]
    while waiting and time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout for p in waiting], [], [], max(0.0, deadline - time.monotonic()))
        for p in [q for q in waiting if q.stdout in ready]:
            p.stdout.readline()  # the READY line, or "" when it died
            waiting.remove(p)


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def _gemm_loop() -> None:
    import torch

    x, w = torch.randn(4, 128, 256), torch.randn(256, 1024)
    _ready()
    while True:
        torch.nn.functional.gelu(x @ w).sum()


def _model_loop(model_path: str, micro_batch: int) -> None:
    import torch

    from autopar.graph.build import one_block_model
    from autopar.modelfile import call_model, load_model_file
    from autopar.profiler.layers import materialise

    mf = load_model_file(model_path)
    meta = mf.build("meta")
    try:
        from autopar.spec import model_spec

        blocks_path: str | None = model_spec(mf, meta).blocks_path
    except Exception:  # noqa: BLE001 - the load must go on (see main): the whole model then
        blocks_path = None
    model = materialise(one_block_model(meta, blocks_path) if blocks_path else meta, torch.device("cpu"),
                        mf.buffer_values())
    model.train()
    inputs = mf.example_inputs(micro_batch, "cpu")
    _ready()
    while True:
        out = call_model(model, inputs)
        loss = mf.loss_fn(out, inputs) if mf.loss_fn is not None else out.float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)


def _ready() -> None:
    try:
        print(READY, flush=True)
        sys.stdout.close()  # nobody reads further; a full pipe must never block the loop
    except (OSError, ValueError):
        pass


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        _model_loop(argv[0], int(argv[1]))
    except Exception:  # noqa: BLE001 - the load must go on: a model that will not build still gets a busy core
        _gemm_loop()


if __name__ == "__main__":
    main(sys.argv[1:])
