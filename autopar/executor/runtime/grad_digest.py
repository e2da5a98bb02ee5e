"""Each parameter's gradient norm after the first step's reduction (``autopar run --grad-norms``):
a plan compared with one rank parameter by parameter.

A plan whose losses match one rank can still train some parameters on wrong gradients: a
replicated layer that feeds every tensor-parallel rank's sharded heads directly gets only its
own rank's share unless the share is summed (multi-head latent attention's rotary key was 0.8 %
off at tp 2 while the losses of three steps agreed to 1e-5). The norms of the full gradients of
the first step -- reduced over data parallelism, tied copies summed, just before the optimizer
step -- show such a fault by name; with the same seed a one-rank run gives the reference.

The full gradients come from ``apply.full_parameters`` (sharded tensors gathered, fused rows
un-permuted, the other expert-parallel ranks' experts added), one collective per parameter mesh:
meant for tests and checks on small models, not for every run of a large one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist


def first_step_grad_norms(exe: Any, first_step: int) -> tuple[Callable[[int], None], dict[str, float]]:
    """(``on_grads(step)`` for ``train``, the dict it fills on every rank at step ``first_step``:
    parameter name -> the L2 norm of its full gradient). Collective over the world."""
    from autopar.executor.parallel.apply import full_parameters

    norms: dict[str, float] = {}

    def on_grads(step: int) -> None:
        if step != first_step:
            return
        full = full_parameters(exe, grads=True)
        c = exe.mesh.coords
        mine = {n: float(t.norm()) for n, t in full.items()} if (c.dp, c.cp, c.tp) == (0, 0, 0) else None
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)  # one pipeline stage's names each
        for part in everyone:
            if part:
                norms.update(part)
    return on_grads, norms


def compare_grad_norms(reference: dict[str, float], got: dict[str, float], rtol: float = 1e-4) -> str | None:
    """None when every parameter's gradient norm matches the reference within ``rtol`` (relative to
    the larger of its own norm and 1e-3 of the model's largest), else the worst mismatch."""
    missing = sorted(set(reference) - set(got))
    if missing:
        return f"no gradient norm for {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    floor = 1e-3 * max(reference.values(), default=0.0)
    worst = max(((abs(got[n] - r) / max(r, floor, 1e-30), n) for n, r in reference.items()), default=(0.0, ""))
    if worst[0] > rtol:
        n = worst[1]
        return f"step 1 gradient of {n}: norm {got[n]:.6g} vs 1 rank {reference[n]:.6g} (rel {worst[0]:.1e})"
    return None
