"""ModelGraph: the network as a networkx DiGraph of layers, with measured costs.

Nodes, in execution order: ``embedding`` (everything before the first block), ``block.0`` ...
``block.{L-1}``, ``head`` (everything after the last block: final norm, output layer) and ``loss``.
Each node carries forward/backward FLOPs (FlopCounterMode's registry, measured on meta), parameter
count and bytes, and bytes saved for backward (saved_tensors_hooks on meta) split into the parts
tensor parallelism divides, the parts Megatron sequence parallelism divides, and the attention core
that selective recompute drops. Pipeline cut points are the edges between blocks.

The numbers on the nodes are per micro-batch of one sample at the model's sequence length and tp=1;
``regions`` hold the fitted per-op tables the cost model evaluates at any shape.

This module is plain data and needs no torch (the planner half loads without it); the graph is
measured by ``graph/measure.py``. The networkx graph is a view of the measured fields, built on
first use (``ModelGraph.graph``): planning reads only the regions, so neither the graph cache nor a
warm ``autopar plan`` imports networkx.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from autopar.graph.scaling import FitQuantity, RegionFit, Shape
from autopar.layout import TPDegrees, tp_heads_reason, ulysses_reason
from autopar.plan import DTYPE_BYTES

if TYPE_CHECKING:
    import networkx as nx


@dataclass(frozen=True, kw_only=True)
class RegionParams:
    """Parameters of one region: total and the part tensor parallelism shards."""

    count: int
    tp_sharded: int
    # Parameter tensors (framework time of measured profiles): FSDP2 and DTensor cost CPU time per tensor, not per byte
    # (autopar.cost.framework). 0: not counted (chain models), then nothing is priced per tensor.
    tensors: int = 0
    # The parameters' shapes as FSDP2 shards them, on dim 0: (rows, elements per row, tensors of that
    # shape) -- what its padding reads (``padding``). Empty: not recorded (chain models), none priced.
    shapes: tuple[tuple[int, int, int], ...] = ()

    def per_rank(self, tp: int) -> float:
        return self.count - self.tp_sharded + self.tp_sharded / tp

    def padding(self, shard_degree: int) -> int:
        """Elements FSDP2's gathered parameters hold beyond the region's own over ``shard_degree``
        ranks: it shards each parameter's dim 0 in chunks of ceil(rows / N) rows, pads every rank's
        chunk to that, and the gathered tensor is a view of the padded all-gather output, N chunks
        long (torch.distributed.fsdp FSDPParam.init_unsharded_param) -- a ViT's position embedding
        (1, 257, 1280) over 64 ranks holds 64 copies' room. Its reduce-scatter input is as long."""
        if shard_degree <= 1:
            return 0
        return sum(count * (-(-rows // shard_degree) * shard_degree - rows) * per_row
                   for rows, per_row, count in self.shapes)


@dataclass(frozen=True, kw_only=True)
class ChainUnit:
    """One unit of a model's layer chain (a model without one repeated block; spec/chain.py).

    ``region``: the fitted region its costs come from (units of one class, shapes and input shape
    share one); ``params``: its own parameters (plus those of modules that run right after it,
    before the next unit); ``input_bytes``: the tensor it receives, one sample at the graph's
    sequence length (what a pipeline cut before it sends, and what full recompute keeps)."""

    name: str
    region: str
    params: int
    input_bytes: float
    experts: bool = False  # it holds the graph's mixture of experts (ModelGraph.moe), which ep shards
    # it saves the very tensor it receives (a pipeline cut's receive buffer: cost/chain.py), the one
    # it returns (what the stage it ends keeps for backward)
    saves_input: bool = False
    saves_output: bool = False

    def __post_init__(self) -> None:
        if self.params < 0 or self.input_bytes < 0:
            raise ValueError(f"chain unit {self.name}: params and input_bytes must be >= 0")


@dataclass(frozen=True, kw_only=True)
class MoEFacts:
    """What the cost model needs of a block's mixture of experts (expert parallelism; a torch-free copy of
    autopar.spec.moe.MoESpec's numbers, so a cached graph loads without torch)."""

    num_experts: int
    top_k: int
    params_per_expert: int
    experts_path: str
    # every module holding the experts' parameters (MoESpec.paths: grouped stacks are several);
    # empty: experts_path alone
    paths: tuple[str, ...] = ()
    # the bytes ep exchanges per MoE layer over one dispatch and one combine of the tokens
    # (MoESpec.exchange_factor: grouped stacks exchange their rows and results each)
    exchange_factor: float = 1.0

    def __post_init__(self) -> None:
        if not (self.num_experts >= 2 and 1 <= self.top_k <= self.num_experts and self.params_per_expert >= 1):
            raise ValueError(f"not a mixture of experts: {self}")

    @property
    def expert_params(self) -> int:
        """Parameters of all experts of one block."""
        return self.num_experts * self.params_per_expert

    @staticmethod
    def of(moe: Any) -> "MoEFacts | None":
        """The facts of an autopar.spec.moe.MoESpec (None: dense)."""
        if moe is None:
            return None
        return MoEFacts(num_experts=moe.num_experts, top_k=moe.top_k, params_per_expert=moe.params_per_expert,
                        experts_path=moe.experts_path, paths=moe.paths, exchange_factor=moe.exchange_factor)


@dataclass(frozen=True, kw_only=True)
class LayerRow:
    """One node of ``ModelGraph.graph``: its name, the region whose fit prices it, and its own counts."""

    name: str
    region: str
    kind: str  # pre | block | post | loss
    num_params: int
    tp_sharded_params: int
    input_bytes: float  # one sample: what a block receives (0 for the embedding, head and loss)


@dataclass(frozen=True, kw_only=True)
class ModelGraph:
    """A model as the planner sees it. Frozen; build with ``build_graph``."""

    name: str
    sha256: str
    num_blocks: int
    seq_len: int  # S: tokens per sample the graph was measured at (1 for non-sequence models)
    is_sequence_model: bool
    dtype: str
    num_heads: int | None
    num_kv_heads: int | None
    tp_reason: str | None  # why TP is not applicable (None: it is)
    cp_reason: str | None
    pp_reason: str | None
    regions: dict[str, RegionFit]
    params: dict[str, RegionParams]  # per region; "block" is one block
    tied_params: int  # parameters used both before and after the blocks (tied embedding)
    block_input_bytes: float  # one sample, tp=1: the tensor a block receives (full recompute keeps it)
    # one sample of the model's inputs as the model file makes them (graph/build.batch_input_bytes): a
    # rank holds its rows of the step's batch on its device through the step (cost.stage)
    batch_input_bytes: float = 0.0
    # whether a block saves that very tensor for backward (its first norm or GEMM reads it): a pipeline
    # chunk's first block then saves its receive buffer, which the buffers price (cost.stage); and the
    # one it returns (a last ReLU saves its output): a chunk's output, which torch pipelining keeps
    block_saves_input: bool = False
    block_saves_output: bool = False
    build_seconds: float = field(compare=False, default=0.0)
    # What the executor can run on this model, per dimension (autopar.spec.support): None = offered,
    # else the reason it is not. Empty: everything the reasons above allow.
    support: Mapping[str, str | None] = field(default_factory=dict)
    tp_source: str = ""  # the TP plan used and where it came from (spec.TPPlan.describe())
    tp_styles: Mapping[str, str] = field(default_factory=dict)  # block-relative name -> colwise|rowwise
    # A chain with a TP plan per unit kind (its tp_styles stay empty): the plan of the units holding
    # the experts (unit-relative), whether it shards them is what the cost model reads of it
    moe_tp_styles: Mapping[str, str] = field(default_factory=dict)
    # A model without one repeated block: its units in forward order (num_blocks of them). Then
    # regions["block"] / params["block"] describe unit 0 only; the cost model reads the units
    # (cost/chain.py). Empty: the blocks repeat.
    chain: tuple[ChainUnit, ...] = ()
    # Which tp degrees run (layout.TPDegrees, from the spec): what ``tp_allowed`` asks. None (a
    # graph built by hand): the heads rule alone.
    tp_degrees: TPDegrees | None = None
    # Expert parallelism: the blocks' mixture of experts (from autopar.spec.moe), None when dense; the cost
    # model prices expert parallelism from it (autopar.cost.expert). A chain: the one its units marked
    # ``experts`` hold.
    moe: MoEFacts | None = None
    # The sequence the graph was traced at where shorter than seq_len: a forward too long to trace at
    # seq_len (a loop over positions) was measured there and extrapolated (graph/short_probe.py).
    # None: traced at seq_len.
    probe_seq_len: int | None = None
    # Pipeline: the tensors a stage after the first receives beside the hidden state (prologue
    # outputs the executor carries, spec.pipeline_probe.Probe.carried), one sample at seq_len, with
    # their batch and sequence exponents (graph/carried.py). Empty: nothing is carried.
    carried: tuple[FitQuantity, ...] = ()
    # What the model returns (its logits), one sample at seq_len, with its batch, sequence and tp
    # exponents (graph/build.TracedRun.output_bytes): torch pipelining's last stage holds it from a
    # micro-batch's forward through its backward (cost.stage). None: not measured.
    output: FitQuantity | None = None

    def carried_bytes(self, micro_batch: float, s_ratio: float) -> float:
        """Bytes a pipeline stage receives beside the hidden state per micro-batch of ``micro_batch``
        samples at ``s_ratio`` of ``seq_len`` (0 when nothing is carried): whole on every rank, since
        a prologue module runs outside the blocks' tensor and sequence parallelism."""
        shape = Shape(b=micro_batch, s_ratio=s_ratio, kv_ratio=s_ratio, t=1.0)
        return sum(q.nbytes * shape.scale(q.exps) for q in self.carried)

    def supports(self, dim: str) -> str | None:
        """None if the executor can run dimension ``dim`` on this model, else the reason."""
        return self.support.get(dim)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def num_params(self) -> int:
        if self.chain:
            return self.params["pre"].count + sum(u.params for u in self.chain) + self.params["post"].count
        return self.params["pre"].count + self.num_blocks * self.params["block"].count + self.params["post"].count

    @functools.cached_property
    def graph(self) -> "nx.DiGraph":
        """The layer graph (module docstring), derived from the measured fields on first use: one
        node per ``layer_rows`` entry, an edge between neighbours, every edge between two blocks a
        pipeline cut point. A chain's nodes also name their unit's region."""
        import networkx as nx

        g = nx.DiGraph()
        base = Shape(b=1, s_ratio=1.0, kv_ratio=1.0, t=1)
        rows = self.layer_rows()
        for i, row in enumerate(rows):
            fit = self.regions[row.region]
            totals = region_totals(fit, base)
            g.add_node(row.name, kind=row.kind, index=i, **({"region": row.region} if self.chain else {}),
                       fwd_flops=totals["fwd_flops"], bwd_flops=totals["bwd_flops"], num_params=row.num_params,
                       tp_sharded_params=row.tp_sharded_params, saved_bytes=totals["saved_bytes"],
                       saved_split=saved_split(fit), input_bytes=row.input_bytes)
            if i:
                prev = rows[i - 1].name
                g.add_edge(prev, row.name, cut_point=prev.startswith("block.") and row.name.startswith("block."))
        g.graph["tied_params"] = self.tied_params
        return g

    def shards_with_tp(self, region: str) -> bool:
        """Whether some op of ``region`` has a fitted tp exponent (a vocab-parallel embedding or
        head: the exponents say which ops tensor parallelism divides, 0 for the rest)."""
        return self._tp_sharded_regions[region]

    @functools.cached_property
    def _tp_sharded_regions(self) -> dict[str, bool]:
        # Read once per region and graph: the cost model asks for every configuration it prices.
        return {name: any(op.flops_exps.t > 0.5 or op.bytes_exps.t > 0.5 for op in fit.ops)
                for name, fit in self.regions.items()}

    def layer_rows(self) -> list[LayerRow]:
        """The nodes of ``graph`` in execution order: the embedding, each block (a chain's units),
        the head, the loss."""
        def edge(name: str, region: str) -> LayerRow:
            p = self.params[region]
            return LayerRow(name=name, region=region, kind=region, num_params=p.count,
                            tp_sharded_params=p.tp_sharded, input_bytes=0.0)

        if self.chain:
            blocks = [LayerRow(name=f"block.{i}", region=u.region, kind="block", num_params=u.params,
                               tp_sharded_params=0, input_bytes=u.input_bytes) for i, u in enumerate(self.chain)]
        else:
            p = self.params["block"]
            blocks = [LayerRow(name=f"block.{i}", region="block", kind="block", num_params=p.count,
                               tp_sharded_params=p.tp_sharded, input_bytes=self.block_input_bytes)
                      for i in range(self.num_blocks)]
        return [edge("embedding", "pre"), *blocks, edge("head", "post"), edge("loss", "loss")]

    def model_flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sample, no recompute (the MFU numerator): the sum over
        the nodes of ``graph``, in its order, read from the regions (no networkx)."""
        base = Shape(b=1, s_ratio=1.0, kv_ratio=1.0, t=1)
        layers = [row.region for row in self.layer_rows()]
        totals = {r: region_totals(self.regions[r], base) for r in set(layers)}
        return sum(totals[r]["fwd_flops"] + totals[r]["bwd_flops"] for r in layers)

    def tp_allowed(self, tp: int) -> str | None:
        """None if ``tp`` is legal for this model, else the reason it is not."""
        if tp == 1:
            return None
        if self.tp_reason:
            return self.tp_reason
        if self.tp_degrees is not None:  # the predicate the executor's preflight asks too
            return self.tp_degrees.reason(tp)
        return tp_heads_reason(tp, self.num_heads, self.num_kv_heads)

    def ulysses_allowed(self, tp: int, cp: int) -> str | None:
        """None if Ulysses context parallelism at (tp, cp) is legal for this model, else the reason."""
        return ulysses_reason(tp, cp, self.num_heads, self.num_kv_heads)


def region_totals(fit: RegionFit, shape: Shape) -> dict[str, float]:
    """FLOPs and saved bytes of a region at ``shape`` (no recompute)."""
    out = {"fwd_flops": 0.0, "bwd_flops": 0.0, "saved_bytes": 0.0}
    for op in fit.ops:
        out[f"{op.phase}_flops"] += op.flops * shape.scale(op.flops_exps)
    out["saved_bytes"] = sum(q.nbytes * shape.scale(q.exps) for q in fit.saved)
    return out


def saved_split(fit: RegionFit) -> dict[str, float]:
    """Saved bytes at the base shape split into what TP divides, what only SP divides, and the
    attention core (s^2 terms) that selective recompute drops."""
    split = {"tp_sharded": 0.0, "sp_sharded": 0.0, "attention_core": 0.0, "other": 0.0}
    for q in fit.saved:
        if q.exps.quadratic:
            split["attention_core"] += q.nbytes
        elif q.exps.t > 0.5:
            split["tp_sharded"] += q.nbytes
        elif q.exps.replicated:
            split["sp_sharded"] += q.nbytes
        else:
            split["other"] += q.nbytes
    return split
