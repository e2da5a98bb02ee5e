"""Every rank builds the same model: a structure digest compared in the job's first collective.

A model file that reads the environment, the rank or a random size builds a different model on
some ranks; the ranks then run collectives of different sizes, which ends in a crash deep in the
communication library (gloo's SIGABRT, NCCL's watchdog) long after the cause. Each rank digests
its model's structure -- every parameter's and buffer's name, shape and dtype, built on the meta
device as preflight builds it -- and the digests are all-gathered once the process group is up,
before the mesh and the model are built; a difference is one line naming the ranks of each model.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

DIGEST_BYTES = 7  # fits a non-negative int64


def structure_digest(model: nn.Module) -> tuple[int, int]:
    """(digest of the names, shapes and dtypes of ``model``'s parameters and buffers, its parameter count)."""
    h = hashlib.sha256()
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in sorted(items, key=lambda nt: nt[0]):
            h.update(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype};".encode())
    count = sum(p.numel() for p in model.parameters())
    return int.from_bytes(h.digest()[:DIGEST_BYTES], "big"), count


def mismatch_line(digests: list[tuple[int, int]]) -> str | None:
    """The one-line error for ranks whose digests differ (index = rank), None when all agree."""
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, d in enumerate(digests):
        groups.setdefault(d, []).append(rank)
    if len(groups) == 1:
        return None

    def ranks(rs: list[int]) -> str:
        shown = ", ".join(map(str, rs[:8])) + (f" (+{len(rs) - 8} more)" if len(rs) > 8 else "")
        return f"rank{'s' if len(rs) > 1 else ''} {shown}"

    parts = [f"{ranks(rs)} {count:,} parameters (structure {digest:014x})"
             for (digest, count), rs in sorted(groups.items(), key=lambda g: g[1][0])]
    return ("the ranks built different models -- " + "; ".join(parts) + "; the model file must build the same "
            "model on every rank (does it read the rank, the environment or a random size?)")


def check_same_model(model: nn.Module, device: torch.device) -> str | None:
    """Collective over the default group: the mismatch line (the same on every rank), or None."""
    import torch.distributed as dist

    digest, count = structure_digest(model)
    mine = torch.tensor([digest, count], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return mismatch_line([(int(t[0]), int(t[1])) for t in every])
