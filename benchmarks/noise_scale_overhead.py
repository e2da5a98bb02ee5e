"""Overhead of measuring the gradient noise scale in ``autopar run`` (executor/runtime/grad_norms.py): the
step time of the same plan with and without the statistics, on gloo ranks on this machine.

Per plan, two executables are built from the same seed (one measured, one not: DDP's communication
hook and FSDP2's wrapped post-backward stay for an executable's lifetime) and trained in
alternation, ``--repeats`` times ``--steps`` steps each; a repeat's figure is the median of its
steps after the warm-up. The overhead is the median over repeats of (with / without − 1); its spread
is the range of the repeats' ratios -- a shared, noisy CPU machine moves step times by more than
the statistics cost, so read the overhead against that spread, not alone.

    python benchmarks/noise_scale_overhead.py [--model examples/gpt_small.py] [--nproc 2] [--steps 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP = 2
PLANS = (("DP (DDP), 2 micro-batches", {"zero": 0}), ("ZeRO-3 (FSDP2), 2 micro-batches", {"zero": 3}))


def _plan(model_file: str, nproc: int, parallel: dict, gbs: int, mbs: int, seq: int, blocks: int):
    from autopar.plan import plan_from_dict

    return plan_from_dict({
        "version": 1,
        "model": {"file": model_file, "num_blocks": blocks},
        "cluster": {"profile": "a100-80g", "num_gpus": nproc, "gpus_per_node": 8},
        "training": {"global_batch_size": gbs, "micro_batch_size": mbs, "seq_len": seq, "dtype": "fp32",
                     "optimizer": "adamw"},
        "parallel": {"dp": nproc, "tp": 1, "pp": 1, **parallel},
    })


def _added_compute_s(exe) -> float:  # noqa: ANN001
    """The least time, over 10 tries, of the passes the statistics add to a step on this rank: the
    squared norm of the local gradient (whole, as the rank computes it before the reduction) and of
    the reduced one (as the rank holds it: a shard under FSDP2). No communication: the all-reduce of
    four scalars is left out."""
    import time

    from autopar.executor.runtime.grad_norms import _sq_norms

    params = [p for part in exe.parts for p in part.parameters()]
    local = [torch.randn(p.shape) for p in params]  # a DTensor's shape is the whole parameter's
    held = [torch.randn_like(p.to_local() if hasattr(p, "to_local") else p) for p in params]
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        _sq_norms(local, [1.0] * len(local), torch.device("cpu"))
        _sq_norms(held, [1.0] * len(held), torch.device("cpu"))
        best = min(best, time.perf_counter() - t0)
    return best


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from autopar.executor.parallel.apply import build_executable
        from autopar.executor.parallel.mesh import build_mesh
        from autopar.executor.runtime.checks import preflight
        from autopar.executor.runtime.introspect import inspect_model
        from autopar.executor.runtime.train import train
        from autopar.modelfile import load_model_file

        mf = load_model_file(args.model)
        spec0 = inspect_model(mf, mf.build("meta"))
        lines = []
        for label, parallel in PLANS:
            plan = _plan(str(args.model), world, parallel, args.global_batch, args.micro_batch, mf.seq_len or 1,
                         spec0.num_blocks)
            spec, _ = preflight(plan, mf, world)
            mesh = build_mesh(plan, torch.device("cpu"))
            exes = {on: build_executable(plan, mf, spec, mesh, seed=0, lr=1e-3, loss_fn=mf.loss_fn) for on in (False, True)}
            medians: dict[bool, list[float]] = {False: [], True: []}
            for r in range(args.repeats):
                for on in ((False, True) if r % 2 == 0 else (True, False)):  # alternate which goes first
                    times = train(exes[on], mf, steps=args.steps, seed=r, measure_noise=on).step_times_s
                    medians[on].append(statistics.median(times[WARMUP:]))
            ratios = [b / a - 1 for a, b in zip(medians[False], medians[True])]
            added = _added_compute_s(exes[True])
            without, with_ = statistics.median(medians[False]), statistics.median(medians[True])
            lines.append(f"{label:34s} {without * 1e3:9.1f} ms {with_ * 1e3:9.1f} ms {100 * statistics.median(ratios):+8.2f} % "
                         f"   {100 * min(ratios):+.2f} .. {100 * max(ratios):+.2f} %"
                         f"   {100 * (max(medians[False]) / min(medians[False]) - 1):5.1f} %"
                         f"   {added * 1e3:6.2f} ms = {100 * added / min(medians[False]):.2f} %")
        if rank == 0:
            Path(out).write_text("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "examples" / "gpt_small.py"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.txt")
        mp.spawn(_worker, args=(args.nproc, port, args, out), nprocs=args.nproc, join=True)
        rows = Path(out).read_text()
    print(f"gradient noise scale overhead: {args.nproc} gloo ranks, {Path(args.model).name}, global batch "
          f"{args.global_batch}, micro-batch {args.micro_batch}; median of steps {WARMUP + 1}-{args.steps} per repeat, "
          f"{args.repeats} repeats alternating")
    print(f"{'plan':34s} {'without':>12s} {'with':>12s} {'overhead':>10s}   {'spread of repeats':>20s}   "
          "without's own spread   added compute (min of 10) / fastest step")
    print(rows, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
