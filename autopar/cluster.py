"""Cluster profiles: GPU, node and network figures, plus efficiency curves, loaded from YAML.

``--cluster NAME`` looks for ``NAME.yaml`` in ./profiles, then in $AUTOPAR_PROFILES, then in the
profiles shipped beside the package; a path to a .yaml file works too. Every missing or malformed
field is a ``ClusterError`` naming the field and the file.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from autopar.errors import AutoparError, ClusterError
from autopar.kernel_tables import (
    MEASURED_ATTENTION_KERNEL,
    AttentionTable,
    GemmTable,
    attention_table_from_dict,
    attention_table_from_rows,
    gemm_table_from_dict,
    gemm_table_from_rows,
    resolve_table_path,
)
from autopar.profile_tables import MeasuredProfile, measured_from_dict, parse_number
from autopar.yamlload import load_yaml

# The shipped profiles: the repository's profiles/ (editable install, source checkout), or the copy
# a regular install puts under <prefix>/share/autopar/profiles (pyproject data-files).
_REPO_PROFILES = Path(__file__).resolve().parent.parent / "profiles"
SHIPPED_PROFILES = _REPO_PROFILES if _REPO_PROFILES.is_dir() else Path(sys.prefix) / "share" / "autopar" / "profiles"


@dataclass(frozen=True, kw_only=True)
class Link:
    """One kind of link, as a collective sees it: bus bandwidth per GPU, per-hop latency, and how
    much of the bandwidth a message of a given size achieves: eff(m) = max_eff * m / (m + half_bytes)."""

    bandwidth_bytes_per_s: float
    latency_s: float
    max_efficiency: float = 1.0
    half_efficiency_bytes: float = 0.0
    # Measured per-collective fits (kind, latency_s, bus bandwidth in bytes/s) from `autopar profile
    # --comm`; a collective listed here is costed with its own fit instead of the figures above.
    fits: tuple[tuple[str, float, float], ...] = ()
    # Measured (`autopar profile --comm`): what a blocking collective between compute costs beyond
    # its fit, waiting for members the OS has descheduled -- ~1.7 ms per call at 4 single-threaded
    # ranks on 2 CPU cores; not measured (0) where every rank has its own device.
    rendezvous_s: float = 0.0
    # NVSwitch with in-switch reduction (H100 NVLS, which NCCL picks for all-reduce inside a node):
    # the all-reduce bus bandwidth it reaches; 0 = no NVLS, all-reduce runs as a ring.
    nvls_bandwidth_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0 or self.rendezvous_s < 0 or self.nvls_bandwidth_bytes_per_s < 0:
            raise ClusterError("link bandwidth must be > 0 and latency, rendezvous >= 0")
        if not 0 < self.max_efficiency <= 1:
            raise ClusterError("link max_efficiency must be in (0, 1]")

    def fit(self, kind: str) -> tuple[float, float] | None:
        """(latency_s, bandwidth_bytes_per_s) measured for ``kind``, or None."""
        for name, latency, bandwidth in self.fits:
            if name == kind:
                return latency, bandwidth
        return None

    def efficiency(self, message_bytes: float) -> float:
        if self.half_efficiency_bytes <= 0:
            return self.max_efficiency
        return self.max_efficiency * message_bytes / (message_bytes + self.half_efficiency_bytes)


@dataclass(frozen=True, kw_only=True)
class GemmEfficiency:
    """Fraction of peak a GEMM of shape (m, n, k) reaches:
    max * prod_d d / (d + half_dim) over d in (m, n, k), m counting the batch of a batched GEMM.
    Small or skinny GEMMs cannot fill the GPU's SMs and tensor-core tiles; large ones approach max."""

    max: float
    half_dim: float
    # Set (> 0): the output-tile form, max * mn / (mn + half_mn^2) * k / (k + half_dim) -- a GEMM
    # fills the SMs with output tiles (any m x n of the same area does), and its k loop hides the
    # tile's load/store prologue; a tall-skinny GEMM with many tiles is not penalised per dimension.
    half_mn: float = 0.0

    def __call__(self, m: float, n: float, k: float) -> float:
        h = self.half_dim
        if self.half_mn > 0:
            area = m * n
            return self.max * area / (area + self.half_mn**2) * (k / (k + h))
        return self.max * (m / (m + h)) * (n / (n + h)) * (k / (k + h))


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Everything the cost model needs to know about the hardware."""

    name: str
    gpu_name: str
    peak_flops: float  # dense bf16/fp16 FLOP/s per GPU
    memory_bytes: float  # device memory per GPU
    memory_bandwidth_bytes_per_s: float
    memory_efficiency: float  # fraction of HBM bandwidth element-wise kernels reach
    attention_efficiency: float  # fraction of peak a fused (flash) attention kernel reaches
    kernel_overhead_s: float  # launch + tail cost of each kernel
    # Fused attention's efficiency falls at short key lengths (fewer tiles per query block):
    # attention_efficiency * s_kv / (s_kv + attention_half_seq); 0 = the same at every length.
    attention_half_seq: float = 0.0
    gemm: GemmEfficiency
    gpus_per_node: int
    intra_node: Link  # NVLink/NVSwitch, bus bandwidth per GPU
    inter_node: Link  # per GPU share of the node's NICs (one rail per GPU)
    # Device memory no tensor of the step holds, per process: the CUDA context and library
    # workspaces (``framework_reserve_bytes``), and each NCCL communicator the plan uses
    # (``nccl_bytes_per_group`` per axis of size > 1; autopar.cost.stage.reserve_bytes).
    framework_reserve_bytes: float
    nccl_bytes_per_group: float = 0.0
    # The share of device memory a plan leaves free (``gpu.memory_margin_fraction``): the cost
    # model's error against rehearsals on the side that runs out of memory, and the caching
    # allocator's slack above the live tensors, which no tensor-level model sees. Plans must fit
    # ``usable_memory_bytes``; 0 = the whole device.
    memory_margin_fraction: float = 0.0
    # Dense FLOP/s of fp32 matmuls as autopar run executes them: TF32 tensor cores on CUDA (the
    # executor sets float32 matmul precision "high"), half of a Hopper's or Ampere's bf16 peak.
    # 0: the same as peak_flops (a CPU profile, measured in fp32). profile_conditions.price_for_run
    # prices an fp32 plan on a datasheet GPU profile at this peak.
    fp32_peak_flops: float = 0.0
    optimizer_bytes_per_param: float = 32.0  # HBM traffic of a fused Adam step per parameter
    # A collective hidden behind compute is not free: its kernels take SMs and HBM bandwidth from the
    # compute it overlaps. This fraction of the hidden time is added to the step.
    overlap_cost_fraction: float = 0.1
    # How the training software behaves (the same GPUs run Megatron-LM and torchtitan differently):
    overlap_grad_reduce: bool = True  # DP gradient collectives overlap the last backward (DDP/FSDP do)
    overlap_param_gather: bool = True  # ZeRO-1's parameter all-gather overlaps the next forward (FSDP2 prefetch)
    tp_comm_overlap: bool = False  # TP collectives pipelined with their GEMMs (Megatron/TE userbuffers)
    fused_grad_accumulation: bool = False  # weight-gradient GEMMs accumulate into the grad buffer in place
    # A transformer block's norms, rotation, activation and residual adds as fused kernels moving
    # each input and output once (Megatron-Core + TE; autopar.cost.fused_elementwise), not the
    # model file's eager ops
    fused_elementwise: bool = False
    # A loop over positions (a reference selective scan, an RNN-style recurrence) as the one fused
    # scan kernel a GPU runs (autopar.cost.fused_scan): None decides by the device (a profile
    # measured on a CPU runs the loop's own ops, every other the kernel); false for a GPU whose
    # software lacks the kernel (HF Mamba/Jamba without mamba-ssm run the reference loop there too)
    fused_scan: bool | None = None
    # How a ring / all-gather context-parallel rank splits its attention into flash kernels
    # (autopar.cost.compute._attention_s): "chunks" (autopar run) or "transformer_engine"
    cp_attention: str = "chunks"
    async_tp_backward: bool = False  # TP backward all-reduce overlaps the weight-gradient GEMM (Megatron)
    pipeline_scatter_gather: bool = False  # a PP send goes 1/tp per rail, re-gathered on NVLink (Megatron)
    # Memory per software stack. ``activation_memory``: "measured" (the model file's own saved
    # tensors, as autopar run keeps them) or "megatron" (Megatron-Core + Transformer Engine's fused
    # layers, autopar.cost.megatron_memory). ``main_grad_bytes``: bytes per parameter of the
    # gradient buffer a ZeRO-0/1 rank keeps whole (0: as autopar run keeps them, autopar.cost.zero;
    # 4: Megatron-LM's fp32 main grads; 2: NeMo's bf16 gradient reduction). A torch.distributed
    # pipelining stage keeps one receive buffer per micro-batch of a step
    # (``pipeline_buffers_per_microbatch``); Megatron's schedules allocate them as they go.
    activation_memory: str = "measured"
    main_grad_bytes: float = 0.0
    # Bytes per gradient element the data-parallel reduction (all-reduce / reduce-scatter) sends;
    # 0 = the training dtype's. autopar run reduces in fp32 at any training dtype (FSDP2's
    # reduce_dtype, DDP over fp32 parameters, ZeRO-1's fp32 accumulators): 4 in its profiles.
    # A Megatron profile's ``main_grad_bytes`` decides instead (it reduces its buffer in place).
    grad_reduce_bytes: float = 0.0
    # The optimizer's own precision (autopar.cost.memory.optimizer_state_bytes_per_param):
    # ``optimizer_moment_bytes`` per element of each moment (4: fp32, as torch's Adam over fp32
    # parameters and Megatron's distributed optimizer keep them; 2: bf16 state, Apex's
    # DistributedFusedAdam with ``dtype`` bf16 as NeMo's ``optim.dtype: bf16`` sets it);
    # ``master_weight_bytes`` per parameter of the master copy beside a 16-bit parameter (None: an
    # fp32 master when the training dtype is 16-bit; 2: Apex's ``store_param_remainders``, the low
    # 16 bits of the fp32 master; 0: no master, the optimizer updates the 16-bit parameter).
    optimizer_moment_bytes: float = 4.0
    master_weight_bytes: float | None = None
    pipeline_buffers_per_microbatch: bool = True
    # Sequence parallelism as DTensor runs it (autopar run, torchtitan): a column-parallel Linear saves
    # its all-gathered, full-sequence input for backward; Megatron-LM saves the shard and gathers again.
    sp_saves_gathered_input: bool = True
    # Sequence parallelism at the model's edges: True where the software runs the embedding's
    # dropout and the final norm on the sequence shard (Megatron-Core; torchtitan's SequenceParallel
    # final norm); False where, as autopar run does, the first block's input is split and the last
    # block's output all-gathered (executor/parallel/tensor_parallel.py), so that whatever a model
    # file does before and after its blocks runs on the whole sequence on every tp rank.
    sp_edges: bool = False
    # autopar run trains the data-parallel kinds without FSDP2's mixed-precision policy (DDP, a
    # single rank) under torch.autocast over fp32 parameters: every Linear saves the bf16 copy of its
    # weight for backward, one per micro-batch in flight. Megatron keeps bf16 parameters instead.
    autocast_weight_copies: bool = True
    # CPU and activation offload: the profile's optional ``host:`` section. 0 = not given:
    # the search offers no offload on this cluster and estimating an offload plan is an error
    # naming the missing figure (autopar.cost.offload.require_host).
    host_memory_bytes_per_node: float = 0.0  # host DRAM of one node, shared by its GPUs
    host_link_bandwidth_bytes_per_s: float = 0.0  # GPU <-> host copies, per GPU with all GPUs copying at once
    cpu_optimizer_params_per_s: float = 0.0  # CPU Adam updates per second of one node (all its sockets)
    # framework time: FSDP2 / DTensor CPU time per parameter tensor beyond the collectives' bytes
    # (autopar.cost.framework), from a measured profile's ``measured.comm.fsdp``; 0 = not measured.
    fsdp_gather_s_per_tensor: float = 0.0
    fsdp_reduce_s_per_tensor: float = 0.0
    dtensor_optimizer_s_per_tensor: float = 0.0
    # Kernel tables (autopar.kernel_tables, the profile's ``kernels:`` section): a GEMM's and a fused
    # attention's rate by its own shape, measured or published, in place of peak x efficiency.
    # ``gemm_dtype``: the table column priced (fp32 plans: profile_conditions.price_for_run);
    # ``attention_kernel``: which of the attention table's kernels the software runs.
    gemm_table: GemmTable | None = field(default=None, compare=False)
    gemm_dtype: str = "bf16"
    attention_table: AttentionTable | None = field(default=None, compare=False)
    attention_kernel: str = ""
    # Share of a kernel table's rate a GPU sustains through training steps: tables are measured on
    # an idle GPU in short bursts, at its boost clock; a training step holds every SM busy for
    # seconds, at the clock its power limit allows (``efficiency.sustained_fraction``; 1: as measured).
    sustained_fraction: float = 1.0
    source: Path | None = field(default=None, compare=False)
    # Measured tables (autopar profile): layer times/memory, kernel curves, collective fits. The
    # cost model consults them where they apply and falls back to the figures above otherwise.
    measured: MeasuredProfile | None = field(default=None, compare=False)

    @property
    def usable_memory_bytes(self) -> float:
        """Device memory a plan may fill: ``memory_bytes`` less the margin (``memory_margin_fraction``)."""
        return self.memory_bytes * (1.0 - self.memory_margin_fraction)

    def gemm_flops_per_s(self, m: float, n: float, k: float) -> float:
        """FLOP/s of an (m x k) @ (k x n) GEMM, m counting a batched GEMM's batch: the GEMM table's
        rate at this shape where the profile has one, else peak x the GEMM efficiency curve."""
        if self.gemm_table is not None:
            return self.gemm_table.rate(m, n, k, self.gemm_dtype) * self.sustained_fraction
        return self.peak_flops * self.gemm(m, n, k)

    def attention_flops_per_s(self, kv_tokens: float, *, head_dim: float = 0.0, causal: bool = False,
                              backward: bool = False) -> float:
        """FLOP/s (torch's full-s^2 count) of a fused attention kernel with ``kv_tokens`` keys per
        query: the attention table's rate for the software's kernel at this key length, head
        dimension and mask where the profile has one (and the op's head dimension was traced),
        else peak x ``attention_efficiency_at`` of the work the kernel does -- a causal flash or
        memory-efficient kernel skips the key blocks above the diagonal, half the full square, so
        its rate on torch's full count is twice that (the convention of the tables' causal rates,
        kernel_tables ``causal_half``)."""
        if self.attention_table is not None and head_dim > 0:
            return self.sustained_fraction * self.attention_table.rate(
                self.attention_kernel, backward=backward, causal=causal, kv_tokens=kv_tokens, head_dim=head_dim)
        return self.peak_flops * self.attention_efficiency_at(kv_tokens) * (2.0 if causal else 1.0)

    def attention_efficiency_at(self, kv_tokens: float) -> float:
        """Fraction of peak a fused attention kernel reaches with ``kv_tokens`` keys per query."""
        if self.attention_half_seq <= 0 or kv_tokens <= 0:
            return self.attention_efficiency
        return self.attention_efficiency * kv_tokens / (kv_tokens + self.attention_half_seq)

    def __post_init__(self) -> None:
        for key in ("peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s"):
            if getattr(self, key) <= 0:
                raise ClusterError(f"cluster profile {self.name}: {key} must be > 0")
        if self.gpus_per_node < 1:
            raise ClusterError(f"cluster profile {self.name}: gpus_per_node must be >= 1")
        for key in ("memory_efficiency", "attention_efficiency"):
            if not 0 < getattr(self, key) <= 1:
                raise ClusterError(f"cluster profile {self.name}: {key} must be in (0, 1]")
        if not 0 < self.sustained_fraction <= 1:
            raise ClusterError(f"cluster profile {self.name}: sustained_fraction must be in (0, 1]")
        if not 0 <= self.overlap_cost_fraction <= 1:
            raise ClusterError(f"cluster profile {self.name}: overlap_cost_fraction must be in [0, 1]")
        for key in ("host_memory_bytes_per_node", "host_link_bandwidth_bytes_per_s", "cpu_optimizer_params_per_s",
                    "fsdp_gather_s_per_tensor", "fsdp_reduce_s_per_tensor", "dtensor_optimizer_s_per_tensor"):
            if getattr(self, key) < 0:
                raise ClusterError(f"cluster profile {self.name}: {key} must be >= 0")

    @property
    def has_host(self) -> bool:
        """Whether the profile gives every figure offload is priced with (its ``host:`` section)."""
        return min(self.host_memory_bytes_per_node, self.host_link_bandwidth_bytes_per_s,
                   self.cpu_optimizer_params_per_s) > 0


def _get(data: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(data, Mapping) or key not in data:
        raise ClusterError(f"{where}: missing key '{key}'")
    return data[key]


def _num(data: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    if default is not None and (not isinstance(data, Mapping) or key not in data):
        return float(default)
    return parse_number(_get(data, key, where), f"{where}: '{key}'")


def _link(data: Any, where: str) -> Link:
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where} must be a mapping")
    return Link(
        bandwidth_bytes_per_s=_num(data, "bandwidth_bytes_per_s", where),
        latency_s=_num(data, "latency_s", where),
        max_efficiency=_num(data, "max_efficiency", where, 1.0),
        half_efficiency_bytes=_num(data, "half_efficiency_bytes", where, 0.0),
        nvls_bandwidth_bytes_per_s=_num(data, "nvls_bandwidth_bytes_per_s", where, 0.0),
    )


def usable_text(cluster: Cluster) -> str:
    """The memory a plan may fill, as the CLI says it: "79.2 GiB", or with a margin
    "76.8 GiB (79.2 less a 3 % margin)"."""
    whole = f"{cluster.memory_bytes / 2**30:,.1f} GiB"
    if not cluster.memory_margin_fraction:
        return whole
    return (f"{cluster.usable_memory_bytes / 2**30:,.1f} GiB ({cluster.memory_bytes / 2**30:,.1f} less a "
            f"{cluster.memory_margin_fraction * 100:g} % margin)")


def memory_margin(value: float, what: str) -> float:
    """``value`` as a memory margin (``Cluster.memory_margin_fraction``, named ``what`` in the
    error): a share of the device's memory from 0 to below 0.5, else a one-line ClusterError."""
    if not 0.0 <= value < 0.5:
        raise ClusterError(f"{what} must be at least 0 and below 0.5 (a share of the device's memory; 0.03 "
                           f"leaves 3 %), got {value:g}")
    return value


def cluster_from_dict(data: Any, name: str, source: Path | None = None) -> Cluster:
    where = f"cluster profile {source or name}"
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where} must be a YAML mapping")
    gpu = _get(data, "gpu", where)
    net = _get(data, "network", where)
    eff = _get(data, "efficiency", where)
    tables = _kernels(data.get("kernels", {}), f"{where} kernels", source)
    gemm_default = 1.0 if tables.get("gemm_table") is not None else None  # a GEMM table replaces the curve
    try:
        cluster = Cluster(
            name=str(data.get("name", name)),
            gpu_name=str(_get(gpu, "name", f"{where} gpu")),
            peak_flops=_num(gpu, "peak_flops", f"{where} gpu"),
            memory_bytes=_num(gpu, "memory_bytes", f"{where} gpu"),
            memory_bandwidth_bytes_per_s=_num(gpu, "memory_bandwidth_bytes_per_s", f"{where} gpu"),
            memory_efficiency=_num(eff, "memory", f"{where} efficiency"),
            attention_efficiency=_num(eff, "attention", f"{where} efficiency"),
            kernel_overhead_s=_num(eff, "kernel_overhead_s", f"{where} efficiency"),
            gemm=GemmEfficiency(max=_num(eff, "gemm_max", f"{where} efficiency", gemm_default),
                                half_dim=_num(eff, "gemm_half_dim", f"{where} efficiency",
                                              None if gemm_default is None else 0.0),
                                half_mn=_num(eff, "gemm_half_mn", f"{where} efficiency", 0.0)),
            gpus_per_node=int(_num(net, "gpus_per_node", f"{where} network")),
            intra_node=_link(_get(net, "intra_node", f"{where} network"), f"{where} network.intra_node"),
            inter_node=_link(_get(net, "inter_node", f"{where} network"), f"{where} network.inter_node"),
            framework_reserve_bytes=_num(gpu, "framework_reserve_bytes", f"{where} gpu"),
            nccl_bytes_per_group=_num(gpu, "nccl_bytes_per_group", f"{where} gpu", 0.0),
            memory_margin_fraction=memory_margin(_num(gpu, "memory_margin_fraction", f"{where} gpu", 0.0),
                                                 f"{where} gpu: 'memory_margin_fraction'"),
            fp32_peak_flops=_num(gpu, "fp32_peak_flops", f"{where} gpu", 0.0),
            optimizer_bytes_per_param=_num(eff, "optimizer_bytes_per_param", f"{where} efficiency", 32.0),
            overlap_cost_fraction=_num(eff, "overlap_cost_fraction", f"{where} efficiency", 0.1),
            attention_half_seq=_num(eff, "attention_half_seq", f"{where} efficiency", 0.0),
            sustained_fraction=_num(eff, "sustained_fraction", f"{where} efficiency", 1.0),
            **_software(data.get("software", {}), f"{where} software"),
            **_host(data.get("host", {}), f"{where} host"),
            **tables,
            source=source,
        )
        if "measured" in data:
            cluster = with_measured(cluster, measured_from_dict(data["measured"], where))
    except ClusterError:
        raise
    except (TypeError, ValueError) as exc:
        raise ClusterError(f"{where}: {exc}") from None
    return cluster


def with_measured(cluster: Cluster, measured: MeasuredProfile) -> Cluster:
    """``cluster`` with a measured profile layered over it: fitted kernel figures replace the
    datasheet ones, the measured per-rank memory baseline replaces the framework reserve, measured
    collective fits attach to the link they were measured on, and the layer tables are kept for the
    cost model (autopar.cost.compute.graph_region_time)."""
    import dataclasses

    f = measured.fitted
    changes: dict[str, Any] = {"measured": measured}
    for key in ("peak_flops", "memory_bandwidth_bytes_per_s", "memory_efficiency", "kernel_overhead_s",
                "optimizer_bytes_per_param"):
        if key in f:
            changes[key] = f[key]
    if "peak_flops" in f:  # measured in the profile's dtype: no datasheet TF32 figure applies
        changes["fp32_peak_flops"] = 0.0
    if "attention_efficiency" in f:
        changes["attention_efficiency"] = f["attention_efficiency"]
    measured_dtype = str(measured.device.get("dtype", "bf16"))
    table = gemm_table_from_rows(measured.gemm, measured_dtype, _measured_source(measured)) if measured.gemm else None
    if table is not None:  # a GPU's own grid of GEMM shapes replaces the published table
        changes.update(gemm_table=table, gemm_dtype=measured_dtype)
    elif "gemm_max" in f or "gemm_half_dim" in f:
        changes["gemm_table"] = None  # measured on this device: its fit replaces a published table
        changes["gemm"] = GemmEfficiency(max=f.get("gemm_max", cluster.gemm.max),
                                         half_dim=f.get("gemm_half_dim", cluster.gemm.half_dim))  # measured: product form
    attention = attention_table_from_rows(measured.attention, MEASURED_ATTENTION_KERNEL,
                                          _measured_source(measured)) if measured.attention else None
    if attention is not None:  # and its own attention rates (torch's flash SDPA) the published ones
        changes.update(attention_table=attention, attention_kernel=MEASURED_ATTENTION_KERNEL)
    if measured.memory_baseline_bytes is not None:
        changes["framework_reserve_bytes"] = measured.memory_baseline_bytes
    if measured.comm:
        link: Link = getattr(cluster, measured.comm_link)
        fits = tuple((k, c.latency_s, c.bandwidth_bytes_per_s) for k, c in sorted(measured.comm.items()))
        base = measured.comm.get("all_reduce") or next(iter(measured.comm.values()))
        changes[measured.comm_link] = dataclasses.replace(
            link, fits=fits, bandwidth_bytes_per_s=base.bandwidth_bytes_per_s, latency_s=base.latency_s,
            max_efficiency=1.0, half_efficiency_bytes=0.0, rendezvous_s=measured.comm_rendezvous_s)
    for key, name in FSDP_KEYS.items():  # framework time: measured with the collectives, on the same ranks
        if key in measured.comm_fsdp:
            changes[name] = measured.comm_fsdp[key]
    try:
        return dataclasses.replace(cluster, **changes)
    except (TypeError, ValueError) as exc:
        raise ClusterError(f"measured profile over {cluster.name}: {exc}") from None


def _measured_source(measured: MeasuredProfile) -> str:
    device = measured.device
    return f"autopar profile --device {device.get('type', '?')} ({device.get('name', 'unnamed device')})"


# measured.comm.fsdp key -> Cluster field (framework time, autopar.cost.framework)
FSDP_KEYS = {"gather_s_per_tensor": "fsdp_gather_s_per_tensor", "reduce_s_per_tensor": "fsdp_reduce_s_per_tensor",
             "optimizer_s_per_tensor": "dtensor_optimizer_s_per_tensor"}

_SOFTWARE_KEYS = ("overlap_grad_reduce", "overlap_param_gather", "async_tp_backward", "pipeline_scatter_gather",
                  "tp_comm_overlap", "fused_grad_accumulation", "fused_elementwise", "fused_scan",
                  "pipeline_buffers_per_microbatch",
                  "sp_saves_gathered_input", "sp_edges", "autocast_weight_copies")
ACTIVATION_MEMORY = ("measured", "megatron")
CP_ATTENTION = ("chunks", "transformer_engine")
MAIN_GRAD_BYTES = (0, 2, 4)
MOMENT_BYTES = (2, 4)
MASTER_BYTES = (0, 2, 4)


def _software(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where} must be a mapping")
    allowed = _SOFTWARE_KEYS + ("activation_memory", "cp_attention", "main_grad_bytes", "grad_reduce_bytes",
                                "optimizer_moment_bytes", "master_weight_bytes")
    unknown = sorted(set(data) - set(allowed), key=str)
    if unknown:
        raise ClusterError(f"{where}: unknown key '{unknown[0]}'; allowed: {', '.join(allowed)}")
    for key, value in data.items():
        if key == "activation_memory":
            if value not in ACTIVATION_MEMORY:
                raise ClusterError(f"{where}: 'activation_memory' must be one of {', '.join(ACTIVATION_MEMORY)}")
        elif key == "cp_attention":
            if value not in CP_ATTENTION:
                raise ClusterError(f"{where}: 'cp_attention' must be one of {', '.join(CP_ATTENTION)}")
        elif key == "main_grad_bytes":
            if isinstance(value, bool) or value not in MAIN_GRAD_BYTES:
                raise ClusterError(f"{where}: 'main_grad_bytes' must be 0 (as autopar run), 2 (bf16) or 4 (fp32)")
        elif key == "grad_reduce_bytes":
            if isinstance(value, bool) or value not in MAIN_GRAD_BYTES:
                raise ClusterError(f"{where}: 'grad_reduce_bytes' must be 0 (the training dtype), 2 (bf16) or 4 (fp32)")
        elif key == "optimizer_moment_bytes":
            if isinstance(value, bool) or value not in MOMENT_BYTES:
                raise ClusterError(f"{where}: 'optimizer_moment_bytes' must be 2 (bf16 state) or 4 (fp32)")
        elif key == "master_weight_bytes":
            if isinstance(value, bool) or value not in MASTER_BYTES:
                raise ClusterError(f"{where}: 'master_weight_bytes' must be 0 (no master copy), 2 (the fp32 "
                                   "master's low 16 bits) or 4 (an fp32 master)")
        elif not isinstance(value, bool):
            raise ClusterError(f"{where}: '{key}' must be true or false")
    return dict(data)


def _kernels(data: Any, where: str, source: Path | None) -> dict[str, Any]:
    """The optional ``kernels:`` section: GEMM and attention tables (autopar.kernel_tables), looked
    up beside the profile, then where profiles are looked up; ``attention_kernel`` must be one of
    the attention table's kernels."""
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where} must be a mapping")
    allowed = ("gemm", "attention", "attention_kernel")
    unknown = sorted(set(data) - set(allowed), key=str)
    if unknown:
        raise ClusterError(f"{where}: unknown key '{unknown[0]}'; allowed: {', '.join(allowed)}")
    dirs = ([source.parent] if source is not None else []) + _profile_dirs()
    out: dict[str, Any] = {}
    for key, parse in (("gemm", gemm_table_from_dict), ("attention", attention_table_from_dict)):
        if key in data:
            if not isinstance(data[key], str):
                raise ClusterError(f"{where}: '{key}' must name a kernel table (profiles/kernels/NAME.yaml) or a path")
            path = resolve_table_path(data[key], dirs)
            out[f"{key}_table"] = _table(path, parse)
    if "attention_table" in out:
        kernel = data.get("attention_kernel")
        known = out["attention_table"].kernels()
        if kernel not in known:
            raise ClusterError(f"{where}: 'attention_kernel' must name the kernel the software runs, one of "
                               f"{', '.join(known)}")
        out["attention_kernel"] = kernel
    elif "attention_kernel" in data:
        raise ClusterError(f"{where}: 'attention_kernel' needs an 'attention' table")
    return out


_TABLES: dict[tuple[str, int, int], Any] = {}


def _table(path: Path, parse: Any) -> Any:
    """A kernel table read once per file version (every profile of a GPU names the same one)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _TABLES:
        _TABLES[key] = parse(_read_yaml(path), f"kernel table {path}")
    return _TABLES[key]


def _profile_dirs() -> list[Path]:
    """Where profiles (and their kernels/ tables) are looked up, in order."""
    dirs = [Path.cwd() / "profiles"]
    if os.environ.get("AUTOPAR_PROFILES"):
        dirs.append(Path(os.environ["AUTOPAR_PROFILES"]))
    dirs.append(SHIPPED_PROFILES)
    return dirs


_HOST_KEYS = {"memory_bytes_per_node": "host_memory_bytes_per_node",
              "link_bandwidth_bytes_per_s": "host_link_bandwidth_bytes_per_s",
              "optimizer_params_per_s": "cpu_optimizer_params_per_s"}


def _host(data: Any, where: str) -> dict[str, float]:
    """The optional ``host:`` section (host offload); absent keys keep the Cluster defaults (0 = not given)."""
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where} must be a mapping")
    unknown = sorted(set(data) - set(_HOST_KEYS), key=str)
    if unknown:
        raise ClusterError(f"{where}: unknown key '{unknown[0]}'; allowed: {', '.join(_HOST_KEYS)}")
    return {field_name: parse_number(data[key], f"{where}: '{key}'") for key, field_name in _HOST_KEYS.items()
            if key in data}


def resolve_profile_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not p.is_file():
            raise ClusterError(f"cluster profile file {p} does not exist")
        return p
    for d in _profile_dirs():
        candidate = d / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(list_profiles())) or "none"
    raise ClusterError(f"unknown cluster profile '{name_or_path}'; known: {known} (or give a path to a .yaml)")


def list_profiles() -> dict[str, Path]:
    """Profile name -> path, shipped ones overridden by ./profiles and $AUTOPAR_PROFILES."""
    found: dict[str, Path] = {}
    dirs = [SHIPPED_PROFILES]
    if os.environ.get("AUTOPAR_PROFILES"):
        dirs.append(Path(os.environ["AUTOPAR_PROFILES"]))
    dirs.append(Path.cwd() / "profiles")
    for d in dirs:
        if d.is_dir():
            for f in sorted(d.glob("*.yaml")):
                try:
                    head = load_yaml(f.read_text(encoding="utf-8"), str(f))
                except (yaml.YAMLError, AutoparError, OSError, UnicodeDecodeError):
                    continue
                if isinstance(head, Mapping) and ("gpu" in head and "network" in head or "base" in head):
                    found[f.stem] = f
    return found


# Per resolved path: the file's (modification time, size) when read, and its Cluster. A profile
# written again at the same path (``autopar profile -o prof.yaml`` in a loop) is read again and
# replaces its entry, not served from memory.
_CACHE: dict[str, tuple[tuple[int, int], Cluster]] = {}


def _read_yaml(path: Path) -> Any:
    try:
        return load_yaml(path.read_text(encoding="utf-8"), f"cluster profile {path}")
    except yaml.YAMLError as exc:
        raise ClusterError(f"cluster profile {path} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    except AutoparError as exc:  # the reader's bounds (yamlload): a profile's error
        raise ClusterError(str(exc)) from None
    except OSError as exc:
        raise ClusterError(f"cannot read profile {path}: {exc.strerror}") from None


def load_cluster_and_profile(cluster: str | None, profile: str | None, default: str) -> Cluster:
    """The cluster for ``--cluster`` and ``--profile`` together.

    ``profile`` is a measured profile (a YAML with a ``measured:`` section): when it is a full
    profile (``gpu`` and ``network`` too) and no ``--cluster`` is given, it is the cluster; otherwise
    its measured section is layered over ``--cluster`` (or ``default``) with ``with_measured``.
    """
    if profile is None:
        return load_cluster(cluster or default)
    path = resolve_profile_path(profile)
    data = _read_yaml(path)
    if not isinstance(data, Mapping) or "measured" not in data:
        raise ClusterError(f"--profile {path} has no 'measured:' section; make one with 'autopar profile'")
    if cluster is None and "gpu" in data and "network" in data:
        return load_cluster(str(path))
    return with_measured(load_cluster(cluster or default), measured_from_dict(data["measured"], f"profile {path}"))


def _merged(base: Any, over: Any) -> Any:
    """``over`` laid over ``base``: mappings merge key by key, anything else replaces."""
    if isinstance(base, Mapping) and isinstance(over, Mapping):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merged(base.get(k), v) if k in base else v
        return out
    return over


def _with_base(data: Any, path: Path, seen: tuple[str, ...] = ()) -> Any:
    """A profile with ``base: OTHER`` is OTHER's profile with this file's keys laid over it (a
    software variant of the same hardware names only what differs). Bases chain; a loop is an error."""
    if not isinstance(data, Mapping) or "base" not in data:
        return data
    base_name = data["base"]
    if not isinstance(base_name, str) or not base_name:
        raise ClusterError(f"cluster profile {path}: 'base' must be a profile name")
    base_path = resolve_profile_path(base_name)
    key = str(base_path.resolve())
    if key in seen or key == str(path.resolve()):
        raise ClusterError(f"cluster profile {path}: 'base: {base_name}' loops back to itself")
    base = _with_base(_read_yaml(base_path), base_path, seen + (str(path.resolve()),))
    over = {k: v for k, v in data.items() if k != "base"}
    return _merged({k: v for k, v in base.items() if k != "name"}, over)


def load_cluster(name_or_path: str) -> Cluster:
    """Load a cluster profile by name or path (cached while the file is unchanged)."""
    path = resolve_profile_path(name_or_path)
    key = str(path.resolve())
    try:
        stat = path.stat()
        version = (stat.st_mtime_ns, stat.st_size)
    except OSError:  # _read_yaml says why in one line
        version = (-1, -1)
    hit = _CACHE.get(key)
    if hit is None or hit[0] != version:
        hit = _CACHE[key] = (version, cluster_from_dict(_with_base(_read_yaml(path), path), path.stem, path))
    return hit[1]
