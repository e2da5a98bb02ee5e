"""An interleaved pipeline rank holds one copy of a shared parameter per chunk (a prologue module
every stage runs, a tied weight): a checkpoint saves it once and a resume restores *every* local
copy, parameters, optimizer moments and buffers alike (executor/checkpoint/checkpoint.py's alias fix-ups).
No process group: the state dict is built and the post-load fix-ups applied directly."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from autopar.executor.checkpoint import checkpoint as ckpt


class _Chunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Embedding(1, 4)  # on every chunk
        self.body = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(2))


def _exe(parts: list[nn.Module]) -> SimpleNamespace:
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return SimpleNamespace(parts=parts, canonical_names={}, permutations={}, optimizer=opt,
                           mesh=SimpleNamespace(device=torch.device("cpu")))


def test_every_local_copy_of_a_shared_parameter_is_restored() -> None:
    a, b = _Chunk(), _Chunk()
    b.body.weight.data.add_(1.0)  # a different value under the same full-model name
    parts = [a, b]  # two chunks of one rank: the same full-model names, as pipeline chunks keep them
    exe = _exe(parts)
    state, fixups = ckpt.build_state(exe, rng=False, for_load=True)
    # one entry per key: the first chunk's live tensors (DCP loads into them)
    assert state["model/gain.weight"] is a.gain.weight and state["buffer/count"] is a.count
    aliases = [f for f in fixups if isinstance(f, ckpt._Alias)]
    assert {f.key for f in aliases} >= {"model/gain.weight", "optim/gain.weight/exp_avg", "buffer/count"}
    # what DCP would load into the first copies
    with torch.no_grad():
        for key, value in state.items():
            value.fill_(7.0 if key.startswith("model/") else 3.0)
    for f in aliases:
        ckpt._apply_alias(f)
    assert torch.equal(b.gain.weight, torch.full((1, 4), 7.0))
    assert torch.equal(exe.optimizer.state[b.gain.weight]["exp_avg"], torch.full((1, 4), 3.0))
    assert torch.equal(b.count, torch.full((2,), 3.0))
    assert torch.equal(b.body.weight, torch.full((4, 4), 7.0))  # same name: also a copy of one entry


def test_saving_writes_the_first_copy_once() -> None:
    a, b = _Chunk(), _Chunk()
    state, fixups = ckpt.build_state(_exe([a, b]), rng=False, for_load=False)
    assert state["model/gain.weight"] is a.gain.weight and not fixups
