"""Memory per rank: model states under ZeRO 0-3 and in-flight activations under each schedule.

Model states per parameter (ZeRO, SC20 Table 1), with ``d`` the training dtype's bytes and ``K`` the
optimizer's fp32 bytes (Adam: fp32 master copy + two moments = 12 with 16-bit training, 8 in fp32
where the parameter is its own master), sharded over the ``N = dp * cp`` ranks that hold the
same weights:

    ZeRO-0   d + d + K            ZeRO-2   d + (d + K) / N
    ZeRO-1   d + d + K / N        ZeRO-3   (d + d + K) / N

K is the software's: Apex's DistributedFusedAdam keeps bf16 moments and no master (K = 4) or the
fp32 master's low 16 bits (K = 10) where NeMo asks it to (``Cluster.optimizer_moment_bytes``,
``master_weight_bytes``).

In-flight micro-batches held by pipeline rank r (0-based) of p with M micro-batches:
GPipe M; 1F1B min(M, p - r); interleaved with v chunks per rank, counted in chunks of n_r / v
blocks: min(M v, 2 (p - r - 1) + (v - 1) p + 1) (Megatron's warm-up; for r = 0 this is
Korthikanti's p v (1 + (p - 1)/(p v))).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from autopar.errors import PlanError

MOMENTS = {"adam": 2, "adamw": 2, "sgd": 1}  # state tensors per parameter (Adam: m and v; SGD: momentum)


def optimizer_state_bytes_per_param(optimizer: str, dtype_bytes: int, *, moment_bytes: float = 4.0,
                                    master_bytes: float | None = None) -> float:
    """Bytes per parameter the optimizer keeps beyond the training-dtype parameter: its moments at
    ``moment_bytes`` each and the master copy (``master_bytes``; None: fp32 beside a 16-bit
    parameter, none where the parameter is fp32). The defaults are torch's and Megatron's (fp32
    state); ``Cluster.optimizer_moment_bytes`` / ``master_weight_bytes`` describe other software."""
    moments = MOMENTS.get(optimizer)
    if moments is None:
        raise PlanError(f"unknown optimizer {optimizer!r}; use adam, adamw or sgd")
    master = (4.0 if dtype_bytes < 4 else 0.0) if master_bytes is None else master_bytes
    return master + moments * moment_bytes


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes per parameter on one rank, split by what they are."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@lru_cache(maxsize=4096)  # a pure function of six scalars, asked tens of thousands of times per search
def state_bytes_per_param(*, zero: int, shard_degree: int, dtype_bytes: int, optimizer: str,
                          moment_bytes: float = 4.0, master_bytes: float | None = None) -> StateBytes:
    """Model-state bytes per parameter on one rank (see the module docstring); ``moment_bytes`` and
    ``master_bytes``: the optimizer's precision (``optimizer_state_bytes_per_param``)."""
    if zero not in (0, 1, 2, 3):
        raise PlanError(f"zero must be 0, 1, 2 or 3; got {zero}")
    n = max(1, shard_degree)
    d = float(dtype_bytes)
    k = optimizer_state_bytes_per_param(optimizer, dtype_bytes, moment_bytes=moment_bytes, master_bytes=master_bytes)
    if zero == 0:
        return StateBytes(params=d, grads=d, optimizer=k)
    if zero == 1:
        return StateBytes(params=d, grads=d, optimizer=k / n)
    if zero == 2:
        return StateBytes(params=d, grads=d / n, optimizer=k / n)
    return StateBytes(params=d / n, grads=d / n, optimizer=k / n)


def loss_inflight_microbatches(schedule: str, pp: int, num_microbatches: int) -> float:
    """Micro-batches whose last chunk's activations (the head and the loss) the last pipeline rank
    holds at its peak: GPipe runs every forward first (M); 1F1B and interleaved 1F1B run the last
    chunk's forward of a micro-batch only in the steady state, right before its backward (1) --
    the interleaved warm-up fills the rank's earlier chunks, (v - 1) pp micro-batch chunks, before
    the last chunk's first forward (Megatron's schedule, as torch.distributed.pipelining's)."""
    if pp == 1:
        return 1.0
    return float(num_microbatches) if schedule == "gpipe" else 1.0


def inflight_microbatches(schedule: str, pp: int, rank: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches (of a whole rank's blocks) whose activations rank ``rank`` holds at its peak;
    non-increasing in ``rank`` for every schedule (the last rank holds the fewest: the bounds of
    cost.host read it there)."""
    m = num_microbatches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    if schedule == "interleaved-1f1b":
        v = virtual_stages
        chunks = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
        return chunks / v
    raise PlanError(f"unknown pipeline schedule {schedule!r}")
