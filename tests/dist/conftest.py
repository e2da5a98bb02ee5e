"""Shared fixtures of the distributed tests: references are computed once per (model, batch)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so spawned workers can import harness

from harness import LR, SEED, STEPS, Case  # noqa: E402


@functools.lru_cache(maxsize=None)
def _reference(model: str, global_batch_size: int, micro_batch_size: int):
    import torch

    from autopar.executor.train import run_reference
    from autopar.modelfile import load_model_file

    case = Case(name="ref", model=model, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
    plan = case.plan()
    mf = load_model_file(plan.model.file)
    torch.set_num_threads(2)
    grads: dict = {}

    def grab(step, model):
        if step == 0:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)})

    losses, model_ = run_reference(mf, plan, steps=STEPS, seed=SEED, lr=LR, on_grads=grab)
    params = {n: p.detach().clone() for n, p in model_.named_parameters(remove_duplicate=False)}
    return losses, params, grads


def reference_for(case: Case):
    return _reference(case.model, case.global_batch_size, case.micro_batch_size)
