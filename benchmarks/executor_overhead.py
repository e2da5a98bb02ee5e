"""Executor overhead: autopar's DP and ZeRO-3 plans vs a hand-written DDP / FSDP2 loop.

Same model (examples/gpt_small.py unless --model), seed, data, micro-batches and AdamW; 2 gloo
ranks on CPU by default. Step time = median of the timed steps after warm-up (data preparation is
outside the timed region in both). Target: autopar / hand-written <= 1.05.

    python benchmarks/executor_overhead.py [--model examples/gpt_small.py] [--steps 6] [--nproc 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP = 2


def _plan(model_file: str, nproc: int, zero: int, gbs: int, mbs: int, seq: int, blocks: int):
    from autopar.plan import plan_from_dict

    return plan_from_dict({
        "version": 1,
        "model": {"file": model_file, "num_blocks": blocks},
        "cluster": {"profile": "a100-80g", "num_gpus": nproc, "gpus_per_node": 8},
        "training": {"global_batch_size": gbs, "micro_batch_size": mbs, "seq_len": seq, "dtype": "fp32", "optimizer": "adamw"},
        "parallel": {"dp": nproc, "tp": 1, "pp": 1, "zero": zero},
    })


def _autopar(plan, mf, steps: int) -> list[float]:
    from autopar.executor.runtime.start import StartOptions, start
    from autopar.executor.runtime.train import train

    exe = start(plan, mf, StartOptions(seed=0, lr=1e-3, device=torch.device("cpu")))  # the group is up (_worker)
    return list(train(exe, mf, steps=steps, seed=0).step_times_s)


def _hand(plan, mf, steps: int, zero: int) -> list[float]:
    """The loop a user would write by hand with DDP or FSDP2."""
    from torch.distributed.fsdp import fully_shard

    from autopar.executor.runtime.train import global_batch, rows
    from autopar.modelfile import call_model

    torch.manual_seed(0)
    model = mf.build("cpu")
    if zero == 3:
        for block in model.get_submodule(mf.pipeline_blocks or "layers"):
            fully_shard(block)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g, mbs, world, rank = plan.training.global_batch_size, plan.training.micro_batch_size, dist.get_world_size(), dist.get_rank()
    per = g // world
    m = per // mbs
    times = []
    for step in range(steps):
        batch = rows(global_batch(mf, g, step, 0), rank * per, (rank + 1) * per)
        t0 = time.perf_counter()
        for i in range(m):
            mb = rows(batch, i * mbs, (i + 1) * mbs)
            ctx = model.no_sync() if zero == 0 and i < m - 1 else _Null()
            with ctx:
                loss = mf.loss_fn(call_model(model, mb), mb) / m
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return times


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from autopar.executor.runtime.introspect import inspect_model
        from autopar.modelfile import load_model_file

        mf = load_model_file(args.model)
        spec = inspect_model(mf, mf.build("meta"))
        seq = mf.seq_len or 1
        rows_ = []
        for zero, label in ((0, "DP (DDP)"), (3, "ZeRO-3 (FSDP2)")):
            plan = _plan(str(args.model), world, zero, args.global_batch, args.micro_batch, seq, spec.num_blocks)
            # Alternate the two loops (hand, autopar, hand, autopar) and keep the faster median of
            # each, so warm-up and machine noise hit both alike.
            hand, ours = [], []
            for _ in range(args.repeats):
                hand.append(statistics.median(_hand(plan, mf, args.steps, zero)[WARMUP:]))
                ours.append(statistics.median(_autopar(plan, mf, args.steps)[WARMUP:]))
            rows_.append((label, min(ours), min(hand)))
        if rank == 0:
            Path(out).write_text(repr(rows_))
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "examples" / "gpt_small.py"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="alternations of the two loops (default 2)")
    args = ap.parse_args()
    if args.steps <= WARMUP:
        ap.error(f"--steps must be > {WARMUP} (the first {WARMUP} are warm-up)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".txt")
    mp.spawn(_worker, args=(args.nproc, port, args, out), nprocs=args.nproc, join=True)
    rows = eval(Path(out).read_text())  # noqa: S307 - our own repr of floats and strings
    print(f"executor overhead: {Path(args.model).name}, {args.nproc} gloo ranks, {args.steps - WARMUP} timed steps (median)")
    print(f"{'plan':18s} {'autopar ms':>11s} {'hand ms':>9s} {'ratio':>7s}  target <= 1.05")
    worst = 0.0
    for label, ours, hand in rows:
        ratio = ours / hand
        worst = max(worst, ratio)
        print(f"{label:18s} {ours * 1e3:11.1f} {hand * 1e3:9.1f} {ratio:7.3f}  {'ok' if ratio <= 1.05 else 'OVER'}")
    return 0 if worst <= 1.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
