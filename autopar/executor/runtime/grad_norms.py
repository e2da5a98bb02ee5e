"""The two squared gradient norms behind the gradient noise scale (executor/runtime/noise_scale.py), measured
where the executor reduces gradients over data parallelism.

Where the local gradient is read -- just before the data-parallel reduction, so nothing is
recomputed and no gradient is copied:

=================  ==================================================================================
wrap               hook
=================  ==================================================================================
DDP                a DDP communication hook (``register_comm_hook``): each bucket's squared norm is
                   taken from the bucket before torch's own all-reduce hook averages it. The training
                   loop runs every micro-batch but the last under ``no_sync``, so the bucket holds
                   the rank's whole local gradient (B_small = the rank's rows of the global batch).
FSDP2 (ZeRO 1-3)   each FSDP2 parameter group's ``post_backward`` (the step that packs the unsharded
and ``replicate``  gradients and reduce-scatters / all-reduces them) is wrapped: when it is about to
                   reduce, the squared norms of the unsharded gradients it will reduce are summed
                   first (``torch._foreach_norm``, fp32). ZeRO-1, and ZeRO-1/2 under a pipeline, reduce
                   once per step (B_small = the rank's rows); ZeRO-2/3 and ``replicate`` in the
                   flat loop, and ZeRO-3 under a pipeline, reduce per micro-batch, and the norms are
                   then those of one micro-batch's gradient (B_small = the micro-batch), averaged.
=================  ==================================================================================

Why not a per-parameter tensor hook (FairScale's way): with gradient accumulation it sees each
micro-batch's gradient, not the accumulated one DDP reduces; and under FSDP2 the parameters autograd
sees are FSDP2's unsharded ones. Why not a manual reduction: it would give up DDP's and FSDP2's
overlap of communication with backward.

The reduced gradient's squared norm is read from ``.grad`` after the step's backward (reductions
done), before the tied copies across pipeline stages are summed: every rank adds its gradients'
local squares, each divided by how many ranks hold the same values (a tp-replicated bias, a
DDP-replicated weight), and one all-reduce over the world sums both figures -- the shards of
FSDP2 and tp and the stages of pp add up to the whole model, and the local figure (divided by dp)
becomes the mean over the dp ranks. That all-reduce of four scalars is the only communication added.
A weight tied across pipeline stages (an embedding and its output head) is counted as its copies,
each with its stage's share of the gradient, in both figures alike.

Not measured (``install`` returns the reason): one data-parallel rank; cp > 1 (a cp rank's gradient
covers part of each sample's tokens: the local gradient of whole samples would need a gradient-sized
sum over cp, not a scalar); ep > 1 (experts reduce over their own groups); 0-d parameters under
FSDP2, which it leaves out of its reduction (a few scalars), are left out of both figures.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.executor.runtime.noise_scale import NormSample

DP_MESH_NAMES = ("dp", "cp", "dp_cp")  # mesh dimensions gradients are reduced over (mesh.py)


@dataclass(frozen=True, kw_only=True)
class Unmeasured:
    """Why a run does not measure the gradient noise scale (one clause for a log line)."""

    reason: str


def _sq_norms(tensors: list[torch.Tensor], weights: list[float], device: torch.device) -> torch.Tensor:
    """Σ weight · |t|² in fp64 on ``device`` (norms taken in fp32 whatever the gradients' dtype).
    No host data goes to the device: this runs in every FSDP2 group's post-backward and on every
    DDP bucket, and a host list copied to a GPU (``torch.tensor(weights, device=...)``) waits for
    the stream to drain, which would stall the backward it measures. The weights (a few distinct
    values: 1 / tp, shard counts) scale a sum each, as Python numbers; ``device`` is the sum's."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    if not tensors:
        return total
    try:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    except (TypeError, RuntimeError):  # an older torch: no dtype argument
        norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]
    # grouped by weight and by the norms' device: a host-offloaded gradient's norm is summed on the
    # host and added as a host scalar (a kernel argument), not copied up one by one
    groups: dict[tuple[float, torch.device], list[torch.Tensor]] = {}
    for n, w in zip(norms, weights):
        groups.setdefault((float(w), n.device), []).append(n)
    for (w, _), group in groups.items():
        total += torch.stack(group).to(torch.float64).square().sum() * w
    return total


def _shard_count(t: torch.Tensor, names: tuple[str, ...] | None = None) -> int:
    """Over how many ranks a DTensor's values are split (its Shard placements; 1 for a plain tensor).
    ``names``: only mesh dimensions with these names count."""
    if not isinstance(t, DTensor):
        return 1
    dims = t.device_mesh.mesh_dim_names or ()
    n = 1
    for i, p in enumerate(t.placements):
        if p.is_shard() and (names is None or (dims[i] if i < len(dims) else "") in names):
            n *= t.device_mesh.size(i)
    return n


class GradNormMeter:
    """Per step (collective): ``begin_step()`` before the forward, ``finish()`` once the step's
    gradients are reduced -> a ``NormSample`` identical on every rank. Built by ``install``."""

    def __init__(self, exe: Any) -> None:
        par = exe.plan.parallel
        self.exe, self.device = exe, exe.mesh.device
        self.dp, self.tp, self.m = par.dp, par.tp, exe.plan.num_microbatches
        self.global_batch = exe.plan.training.global_batch_size
        self.pipelined = exe.schedule is not None
        self._local = torch.zeros((), dtype=torch.float64, device=self.device)
        self._reductions: dict[Any, int] = {}
        self._fsdp_kinds = [w.kind == "fsdp" for w in exe.dp]

    # -- the hooks (module docstring)
    def _add_local(self, key: Any, sq: torch.Tensor) -> None:
        self._local += sq
        self._reductions[key] = self._reductions.get(key, 0) + 1

    def ddp_bucket(self, bucket: Any) -> None:
        self._add_local(("ddp", bucket.index()), _sq_norms([bucket.buffer()], [1.0], self.device))

    def fsdp_post_backward(self, group: Any, original: Callable[..., Any], *args: Any) -> Any:
        if getattr(group, "reduce_grads", True):
            grads, weights = [], []
            for fp in group.fsdp_params:
                if not hasattr(fp, "_unsharded_param"):
                    continue
                fp.accumulate_unsharded_grad_if_needed()  # what post_backward does first (idempotent)
                if fp.unsharded_accumulated_grad is not None:
                    grads.append(fp.unsharded_accumulated_grad_data)
                elif fp.unsharded_param.grad is not None:
                    grads.append(fp.unsharded_grad_data)
                else:
                    continue
                # the local tp shard: held once per tp rank if sharded over tp, tp times if replicated
                weights.append(_shard_count(fp.sharded_param, _non_dp_names(fp.sharded_param)) / self.tp)
            if grads:
                self._add_local(("fsdp", id(group)), _sq_norms(grads, weights, self.device))
        return original(*args)

    # -- per step
    def begin_step(self) -> None:
        self._local.zero_()
        self._reductions.clear()

    def _big_local(self) -> torch.Tensor:
        """This rank's share of the reduced gradient's squared norm (module docstring)."""
        slice_ranks = self.dp * self.tp  # ranks of one pipeline stage (cp is 1 here)
        grads, weights = [], []
        seen: set[int] = set()
        for part, fsdp in zip(self.exe.parts, self._fsdp_kinds):
            for p in part.parameters():
                if id(p) in seen or p.grad is None or (fsdp and p.dim() == 0):
                    continue
                seen.add(id(p))
                g = p.grad
                if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                    grads.append(g.full_tensor())
                    weights.append(1.0 / slice_ranks)
                    continue
                grads.append(g.to_local() if isinstance(g, DTensor) else g)
                weights.append(_shard_count(g) / slice_ranks)
        return _sq_norms(grads, weights, self.device)

    def finish(self) -> NormSample:
        """The step's two figures (collective over the world: one all-reduce of 4 scalars)."""
        n_sync = max(self._reductions.values(), default=0)
        # a reduction's input is g_b / n_sync in the flat loop (each micro-batch's loss / m) and
        # g_b · m / n_sync under a pipeline (unscaled losses; the stage divides after reducing)
        scale = (n_sync / self.m) ** 2 if self.pipelined else 1.0
        local = self._local * (n_sync * scale / self.dp) if n_sync else self._local * 0
        packed = torch.stack([local, self._big_local(),
                              torch.tensor(float(n_sync), dtype=torch.float64, device=self.device),
                              torch.tensor(float(n_sync > 0), dtype=torch.float64, device=self.device)])
        dist.all_reduce(packed)
        small, big, syncs, ranks = packed.tolist()
        per_rank = syncs / ranks if ranks else 0.0
        if ranks == 0 or abs(per_rank - round(per_rank)) > 1e-9:
            raise RuntimeError(f"gradient noise scale: ranks disagree on the reductions per step ({syncs} over {ranks})")
        return NormSample(small_sq=small, big_sq=big, b_small_samples=self.global_batch // (self.dp * round(per_rank)),
                          b_big_samples=self.global_batch)


def _ddp_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP rejects string annotations (this module's __future__)
    """DDP's communication hook: the bucket's squared norm, then torch's own averaging all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    meter, process_group = state
    meter.ddp_bucket(bucket)
    return allreduce_hook(process_group, bucket)


def _non_dp_names(t: torch.Tensor) -> tuple[str, ...]:
    names = (t.device_mesh.mesh_dim_names or ()) if isinstance(t, DTensor) else ()
    return tuple(n for n in names if n not in DP_MESH_NAMES)


def _fsdp_groups(module: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return []
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before per-parameter-mesh groups: one optional group
        one = getattr(state, "_fsdp_param_group", None)
        groups = [one] if one is not None else []
    return list(groups)


def install(exe: Any) -> GradNormMeter | Unmeasured:
    """Hook a meter into ``exe``'s data-parallel reduction (once per Executable: a second call
    returns the first meter), or say why this run is not measured."""
    par = exe.plan.parallel
    if par.dp < 2:
        return Unmeasured(reason="one data-parallel rank: nothing to compare the reduced gradient with")
    if par.cp > 1:
        return Unmeasured(reason="cp > 1: a cp rank's gradient covers part of each sample's tokens, and the "
                                 "gradient of whole samples would need a gradient-sized sum over cp")
    if par.ep > 1:
        return Unmeasured(reason="ep > 1: experts reduce their gradients over their own groups")
    existing = getattr(exe, "_grad_norm_meter", None)
    if existing is not None:
        return existing
    meter = GradNormMeter(exe)
    for w in exe.dp:
        if w.kind == "ddp":
            if not isinstance(w.module, nn.parallel.DistributedDataParallel):
                return Unmeasured(reason="DDP stand-in (a rehearsal)")
            w.module.register_comm_hook((meter, w.module.process_group), _ddp_hook)
        elif w.kind in ("fsdp", "replicate"):
            groups = [g for module in w.module.modules() for g in _fsdp_groups(module)]
            if any(len(getattr(g, "modules", ())) > 1 for g in groups):
                # data_parallel.shared_module_groups: a group of modules several blocks share runs
                # its post-backward once per use, each reducing part of the micro-batch's gradient
                return Unmeasured(reason="a parameter group that several blocks share reduces once per use, "
                                         "each time a part of the gradient")
            for group in groups:
                group.post_backward = functools.partial(meter.fsdp_post_backward, group, group.post_backward)
        else:
            return Unmeasured(reason=f"data-parallel wrap {w.kind!r}")
    exe._grad_norm_meter = meter
    return meter
