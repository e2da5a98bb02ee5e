"""CPU and activation offload: what it moves to host memory, what it costs, per rank and node.

Priced as autopar's executor runs it (autopar/executor/parallel/offload.py), over the terms of the same
configuration without offload (``offloaded_terms``). With P the parameters of a rank, N = dp * cp
the ZeRO shard degree, s = 1/N at ZeRO >= 1 (else 1) the share of P a rank's optimizer steps, d the
training dtype's bytes, K the optimizer's fp32 bytes per parameter (Adam: master + 2 moments = 12),
B the host link bandwidth per GPU and R = node CPU-Adam rate / GPUs of the node (each GPU's share of
the host's cores, all GPUs stepping at once):

optimizer (ZeRO-Offload style)
    GPU keeps params and grads; host keeps s K bytes per parameter. After the last backward the
    rank's gradient shard goes down, the CPU steps it and the updated shard comes up. The executor
    does these one after the other (the step needs every gradient; the next forward needs every
    parameter), so nothing overlaps:  optimizer time per parameter = s (2 d / B + 1 / R).
    This is exactly ``StageTerms.optimizer_s_per_param`` (the ILP's tail coefficient) with the GPU
    memory of the optimizer states (``state_split['optimizer']``) set to 0.

params (+ grads + optimizer: FSDP2 ``CPUOffloadPolicy``, ZeRO-3 only)
    GPU keeps no model state beyond the gathered working set (``transient_bytes``, unchanged);
    host keeps (2 d + K) / N bytes per parameter. Each all-gather first copies the piece's shard
    up (P d / N / B) on FSDP2's all-gather stream, and each reduce-scatter's output goes down the
    same way, so these copies hide behind compute exactly as the collectives they extend do
    (autopar.cost.zero.per_microbatch_exposed with ``host_copy_s``). The optimizer steps the
    host shard on the CPU: optimizer time per parameter = s / R (nothing left to copy).
    ``state_bytes_per_param`` and ``state_split`` become 0.

activations (recompute none)
    Every tensor a block saves for backward is copied to the host as it is saved and back when
    backward needs it (``saved_tensors_hooks``, like ``torch.autograd.graph.save_on_cpu``). The
    copies run on the compute stream (the pack hook's copy is synchronous; the unpack's result is
    used at once), so they add fully: block forward += a / B, block backward += a / B, with a the
    bytes a block saves per micro-batch. GPU activations of the blocks become 0 (embedding and head
    stay); one block's saved bytes stay as a working set in backward (``transient_bytes``). Host
    holds in-flight(r) * blocks(r) * a per rank.

Host memory is a per-node constraint: the sum over a node's GPUs (ranks laid out [pp, dp, cp, tp],
node = rank // gpus_per_node) must not exceed the profile's host memory per node. It is checked on
the split the ILP picks (autopar.cost.host: ``OffloadedEstimate.fits``), not inside the ILP: a split
that overflows the host rejects the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from autopar.cost.comm import axis_link
from autopar.cost.evolve import evolve
from autopar.cost.framework import dp_wrapper
from autopar.cost.memo import IdentityMemo
from autopar.cost.zero import per_microbatch_exposed, rank_state_bytes
from autopar.errors import PlanError
from autopar.layout import Layout

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.cost.terms import Config, Part, StageTerms
    from autopar.graph.model_graph import ModelGraph


@dataclass(frozen=True, kw_only=True)
class OffloadCost:
    """What offload adds to a configuration's terms (module docstring); seconds and bytes."""

    label: str
    host_state_bytes_per_param: float  # model-state bytes per rank parameter kept on the host
    host_act_bytes_per_block: float  # per block per in-flight micro-batch (activation offload)
    step_copy_bytes_per_param: float  # optimizer offload: gradient down + parameter up, per rank parameter
    microbatch_copy_bytes_per_param: float  # FSDP2 offload: shard up per gather + grad shard down, per micro-batch
    act_copy_s_per_block: float  # activation offload, forward + backward, one micro-batch
    cpu_step_s_per_param: float  # the CPU's optimizer time per rank parameter
    link_bandwidth_bytes_per_s: float
    host_memory_bytes_per_node: float


def require_host(cluster: "Cluster") -> None:
    """A one-line error when ``cluster`` cannot price offload (its profile has no ``host:`` figures)."""
    if not cluster.has_host:
        raise PlanError(f"cluster profile {cluster.name} gives no host: section (memory_bytes_per_node, "
                        "link_bandwidth_bytes_per_s, optimizer_params_per_s), so offload cannot be priced; "
                        "add one to the profile or plan without parallel.offload")


# The terms without offload that offload modes of one config share (the search prices up to five
# modes over one base), per graph and cluster object and plain config (autopar.cost.memo).
_BASE_TERMS: IdentityMemo["StageTerms"] = IdentityMemo(4096)


def offloaded_terms(graph: "ModelGraph", cluster: "Cluster", cfg: "Config",
                    build: Callable[["ModelGraph", "Cluster", "Config"], "StageTerms"]) -> "StageTerms":
    """The terms of ``cfg``: those of the same config without offload (``build``, i.e.
    cost.stage.build_terms) with ``cfg.offload`` priced in (module docstring)."""
    from autopar.plan import NO_OFFLOAD, offload_reason

    off = cfg.offload
    reason = offload_reason(off, zero=cfg.zero, recompute=cfg.recompute, ep=cfg.ep)
    if reason:
        raise PlanError(reason)
    require_host(cluster)
    plain = evolve(cfg, offload=NO_OFFLOAD)
    base = _BASE_TERMS.get((graph, cluster), plain, lambda: build(graph, cluster, plain))
    bw = cluster.host_link_bandwidth_bytes_per_s
    gpus_on_node = min(cluster.gpus_per_node, cfg.num_gpus)
    rate = cluster.cpu_optimizer_params_per_s / gpus_on_node
    n = cfg.dp * cfg.cp
    share = 1.0 / n if cfg.zero >= 1 else 1.0
    d = float(cfg.dtype_bytes)
    split = dict(base.state_split)
    mixed = base.recompute_parts
    block, pre, post = base.block, base.pre, base.post
    host_state, step_copy, mb_copy, act_copy_s = 0.0, 0.0, 0.0, 0.0
    optimizer_s = base.optimizer_s_per_param
    transient = base.transient_bytes
    if off.params:  # FSDP2 CPUOffloadPolicy: everything sharded lives on the host
        host_state = base.state_bytes_per_param
        split = {k: 0.0 for k in split}
        link = axis_link(cluster, Layout.of(cfg), "dp_cp")
        block, pre, post = (_with_host_copies(cfg, p, link, cluster, bw, n) for p in (block, pre, post))
        if base.recompute_parts is not None:  # a per-stage recompute mix: each mode's block alike
            mixed = {m: _with_host_copies(cfg, p, link, cluster, bw, n) for m, p in base.recompute_parts.items()}
        mb_copy = 3 * d / n  # zero 3: shard up for the forward and the backward gather, grad shard down
        optimizer_s = share / rate
    elif off.optimizer:  # ZeRO-Offload style: states on the host, the step on the CPU
        # the split of this config, not of the one without offload: the executor keeps 16-bit device
        # parameters here, so FSDP2's fp32 shards (cost.zero.fp32_shards) are the host's masters
        state = rank_state_bytes(cfg, cluster)
        split = {"params": state.params, "grads": state.grads, "optimizer": state.optimizer}
        host_state = split["optimizer"]
        split["optimizer"] = 0.0
        split["params"] += _stored_device_params(cfg, d, n)
        step_copy = share * 2 * d
        optimizer_s = share * (2 * d / bw + 1 / rate)
    act = block.act_bytes
    if off.activations:
        act_copy_s = 2 * act / bw
        transient += act  # one block's saved tensors back on the GPU during its backward
        block = evolve(block, fwd_s=block.fwd_s + act / bw, bwd_s=block.bwd_s + act / bw, act_bytes=0.0)
    cost = OffloadCost(
        label=off.label, host_state_bytes_per_param=host_state, host_act_bytes_per_block=act if off.activations else 0.0,
        step_copy_bytes_per_param=step_copy, microbatch_copy_bytes_per_param=mb_copy, act_copy_s_per_block=act_copy_s,
        cpu_step_s_per_param=share / rate if off.states else 0.0, link_bandwidth_bytes_per_s=bw,
        host_memory_bytes_per_node=cluster.host_memory_bytes_per_node)
    return evolve(base, config=cfg, block=block, pre=pre, post=post, state_split=split, recompute_parts=mixed,
                   state_bytes_per_param=sum(split.values()), optimizer_s_per_param=optimizer_s,
                   transient_bytes=transient, offload=cost,
                   # the blocks' saved activations, a chunk's received input among them, go to the host
                   received_saved_bytes=0.0 if off.activations else base.received_saved_bytes)


def _stored_device_params(cfg: "Config", d: float, n: int) -> float:
    """Bytes per parameter of the parameters FSDP2 stores on the device under optimizer offload,
    beside the compute copy the state split already prices as params: the executor casts them to
    the training dtype (their fp32 masters live on the host, data_parallel ``host_masters``), and
    FSDP2 still gathers a separate unsharded copy to compute with -- the shard (1/N) under
    ``fully_shard`` at ZeRO 1-2, the whole parameter under ``replicate`` (rehearsed: GPT-3 at dp 1
    tp 8 pp 8, 5.26 GiB stored beside 5.06 gathered on stage 0). ZeRO-3's params already are
    the shard; DDP and an unwrapped part keep no second copy."""
    wrapper = dp_wrapper(cfg)
    if wrapper == "replicate":
        return d
    if wrapper == "fully_shard" and cfg.zero < 3:
        return d / n
    return 0.0


def _with_host_copies(cfg: "Config", part: "Part", link: Any, cluster: "Cluster", bw: float, n: int) -> "Part":
    """``part`` with its ZeRO-3 collectives each extended by the host copy of its shard."""
    bwd_plain = part.bwd_s - part.zero_comm_s
    copy_s = part.params * cfg.dtype_bytes / n / bw
    zero = per_microbatch_exposed(cfg, part.params, part.fwd_s, bwd_plain, link, cluster,
                                  host_copy_s=copy_s)
    return evolve(part, bwd_s=bwd_plain + zero, zero_comm_s=zero)
