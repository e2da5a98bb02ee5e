"""(GPU readiness, B16) a checkpoint's whole fused-QKV tensors (tp > 1: stored whole and
un-permuted, with their Adam moments) are held on the host, not on the device: every layer's at once
-- GPT-NeoX 20B at tp 4 holds about 60 GB of them -- would not fit a GPU beside the model, at the
save and at the resume. The mesh's device is a stand-in here ("meta" for a GPU), so a placeholder
put on the mesh's device shows. No process group: plain tensors, no gather."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from autopar.executor.checkpoint import checkpoint as ckpt


def _exe(model: nn.Module, perm: torch.Tensor) -> SimpleNamespace:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return SimpleNamespace(parts=[model], canonical_names={}, permutations={"qkv.weight": perm}, optimizer=opt,
                           mesh=SimpleNamespace(device=torch.device("meta")))


def test_whole_fused_tensors_wait_on_the_host_for_the_load() -> None:
    model = nn.Sequential()
    model.add_module("qkv", nn.Linear(4, 6, bias=False))
    perm = torch.tensor([0, 2, 4, 1, 3, 5])  # rows as a tp rank's shards lay them out
    exe = _exe(model, perm)
    state, fixups = ckpt.build_state(exe, rng=False, for_load=True)
    held = [f.key for f in fixups]  # the whole tensors: the weight and its moments (not the step count)
    assert set(held) == {"model/qkv.weight", "optim/qkv.weight/exp_avg", "optim/qkv.weight/exp_avg_sq"}
    assert all(state[k].device.type == "cpu" for k in held)  # was the mesh's device: a GPU at resume
    whole = torch.arange(24.0).reshape(6, 4)  # what DCP would read: the un-permuted whole weight
    fix = next(f for f in fixups if f.key == "model/qkv.weight")
    ckpt._apply_fixup(fix, whole)
    assert torch.equal(model.qkv.weight.detach(), whole[perm])


def test_saving_un_permutes_onto_the_host() -> None:
    perm = torch.tensor([0, 2, 4, 1, 3, 5])
    whole = torch.arange(24.0).reshape(6, 4)
    saved = ckpt._full_unpermuted(whole[perm], perm)
    assert saved.device.type == "cpu" and torch.equal(saved, whole)
