"""Context parallelism's attention memory against the sequence: linear, not quadratic.

For each kind of the executor's context-parallel attention (ring, all-gather KV, Ulysses) at cp 2,
one cp rank's attention core runs forward on its local shard with the collectives looped back on
one process (the layer profiler's ``_loopback``: same shapes, same local work), and the bytes it
saves for backward (distinct storages) are printed per total sequence length. Flash-style blocks
keep O(s) -- the local q, k, v, output and log-sum-exp -- where explicit score matrices kept
O(s^2) (GPU readiness review, B1); the "s^2 scores" column is what one fp32 score matrix of the
local queries against all keys would hold, for scale.

    python benchmarks/cp_memory.py [--seqs 1024,2048,4096,8192,16384] [--heads 8] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.report import table  # noqa: E402

KINDS = ("ring", "allgather", "ulysses")


def saved_bytes(kind: str, seq: int, *, cp: int = 2, heads: int = 8, head_dim: int = 64, batch: int = 1,
                dtype: torch.dtype = torch.float32) -> int:
    """Bytes one cp rank's attention core saves for backward at total sequence ``seq`` (distinct
    storages, the inputs q, k, v included)."""
    from autopar.executor.parallel.context_parallel import ContextParallelAttention
    from autopar.profiler.layers import _loopback

    attn = ContextParallelAttention(kind, None, cp, 0, seq)
    q, k, v = (torch.randn(batch, heads, seq // cp, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with _loopback(cp), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(q, k, v)
    return sum(storages.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    t0 = time.perf_counter()
    rows, first = [], {}
    for seq in seqs:
        row = [f"{seq:,}"]
        for kind in KINDS:
            b = saved_bytes(kind, seq, heads=args.heads, head_dim=args.head_dim)
            first.setdefault(kind, (seq, b))
            s0, b0 = first[kind]
            row.append(f"{b / 2**20:.2f} (x{b / b0:.1f})")
        scores = args.heads * (seq // 2) * seq * 4
        row.append(f"{scores / 2**20:.1f}")
        rows.append(tuple(row))
    print(f"one cp rank (cp 2) of causal attention, b 1, {args.heads} heads x {args.head_dim}, fp32: MiB saved for "
          f"backward (x: against the shortest sequence; linear = the sequence's ratio)")
    print(table(["sequence", *KINDS, "s^2 scores MiB"], rows))
    print(f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
