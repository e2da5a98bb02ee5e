"""``ModelSpec``: the structural facts about one model that the planner, the profiler and the executor
read (built by ``autopar.spec.model_spec()``), and ``DIMENSIONS``, the plan
dimensions whose support it records (one predicate each in ``spec/support.py``). A module of its own
so that the predicates can name the type without importing the package that computes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from autopar.layout import TPDegrees
from autopar.spec.attention import HFAttention
from autopar.spec.blocks import Probe
from autopar.spec.chain import Chain
from autopar.spec.chain_tp import KindPlan
from autopar.spec.moe import MoESpec
from autopar.spec.tp_plan import TPPlan

__all__ = ["DIMENSIONS", "ModelSpec"]

# the support keys (spec/support.py: one predicate each; docs/design.md lists what each means)
DIMENSIONS = ("tp", "sp", "pp", "cp", "zero3", "selective", "full", "op", "cp_pp", "ep")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Structural facts about one model (see the module docstring). Names are dotted paths from the
    model's root, except ``tp.styles`` and ``core_name``, which are block-relative."""

    blocks_path: str  # a chain model (blocks_kind "chain"): the container of its first unit
    num_blocks: int  # a chain model: the number of units in its chain
    blocks_kind: str  # "ModuleList" | "Sequential" | "chain"
    tp: TPPlan
    core_name: str | None
    num_heads: int | None
    num_kv_heads: int | None
    accepts_positions: bool
    vocab_embedding: str | None = None
    vocab_head: str | None = None
    tied: tuple[tuple[str, ...], ...] = ()
    probe: Probe | None = None
    sp_parents_keyword: tuple[str, ...] = ()  # colwise parents called with keyword-only input (not for MoE)
    sp_check: str | None = None  # why SP does not run block 0 exactly (spec/sp_check.py), None: it does
    # rowwise layers (block-relative) whose output the block's code modifies in place (spec/inplace.py):
    # the executor hands their local output on as a copy, since to_local()'s view may not be written
    tp_inplace_outputs: tuple[str, ...] = ()
    bare_params: tuple[str, ...] = ()  # parameters not inside any module the pipeline places
    inputs_are_tensors: bool = True
    inputs_are_token_batch: bool = False
    # A Hugging Face causal-LM batch (``{"input_ids": ids, "labels": ids}``, spec.token_dict_keys):
    # the key of its (batch, seq) token tensor and of its labels (None: the batch has none, the
    # tokens are their own labels). token_key None: the inputs are not such a dict.
    token_key: str | None = None
    labels_key: str | None = None
    is_sequence_model: bool = False
    hf_attention: HFAttention | None = None  # attention dispatched by transformers' interface (spec/attention.py)
    # why block 0 is not exact under context parallelism: it mixes positions outside its attention
    # (spec/cp_check.py); None: it does not, or the check did not run
    cp_mixing: str | None = None
    # the meta forward saw a router (spec/meta.py: a top-k or top-1 over expert scores): which
    # parameters get a gradient depends on the batch (an expert no token chose gets none on that rank)
    routed: bool = False
    support: Mapping[str, str | None] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    # The layer chain a pipeline cuts at unit inputs (spec/chain.py): a model without a repeated
    # block list, or a block list kept in an nn.Sequential. None: the block list is cut as a list.
    chain: Chain | None = None
    # A chain read as one module list (chain.block_list): the TP plan of each unit kind, in chain
    # order (spec/chain_tp.py); empty otherwise. ``tp`` stays empty for a chain.
    kind_tp: tuple[KindPlan, ...] = ()
    # Which tp degrees run (spec/tp_degree.py): the one predicate of a degree, asked by the search
    # (through the graph), estimate and the executor's preflight. Default: the heads rule alone.
    tp_degrees: TPDegrees = field(default_factory=TPDegrees)

    def __post_init__(self) -> None:
        if self.tp_degrees.num_heads is None and self.num_heads is not None:  # a spec built by hand
            object.__setattr__(self, "tp_degrees", TPDegrees(num_heads=self.num_heads,
                                                             num_kv_heads=self.num_kv_heads))

    @property
    def unit_paths(self) -> tuple[str, ...]:
        """Dotted paths of the units a pipeline places and FSDP wraps one by one: the chain's
        units, or the blocks of the block list."""
        if self.chain is not None:
            return self.chain.units
        return tuple(f"{self.blocks_path}.{i}" for i in range(self.num_blocks))
    # The blocks' mixture of experts (autopar.spec.moe), None when dense. A chain: the experts every
    # unit of ``expert_units`` holds (block-relative names read from each of them), None where those
    # units' experts differ.
    moe: MoESpec | None = None
    # A chain (blocks that differ): the units holding experts (a router's top-k among expert
    # weights) -- DeepSeek's MoE layers after its dense first ones. Empty for a block list, whose
    # every block holds ``moe``.
    expert_units: tuple[str, ...] = ()

    @property
    def moe_units(self) -> tuple[str, ...]:
        """Dotted paths of the units whose experts expert parallelism shards: ``expert_units`` of a
        chain, every block of a block list with experts; () when dense."""
        if self.moe is None:
            return ()
        return self.expert_units if self.chain is not None and self.expert_units else self.unit_paths

    def unit_tp(self, index: int) -> TPPlan:
        """The TP plan of block (or chain unit) ``index``: the block plan, or for a chain with plans
        per unit kind the plan of that unit's kind (empty styles: the unit stays replicated)."""
        if not self.kind_tp:
            return self.tp
        kind = self.chain.kinds[index]
        return next(kp.plan for kp in self.kind_tp if kp.kind == kind)

    def unit_inplace_outputs(self, index: int) -> tuple[str, ...]:
        """``tp_inplace_outputs`` of block (or chain unit) ``index`` (see ``unit_tp``)."""
        if not self.kind_tp:
            return self.tp_inplace_outputs
        kind = self.chain.kinds[index]
        return next(kp.inplace_outputs for kp in self.kind_tp if kp.kind == kind)

    @property
    def tp_plan(self) -> Mapping[str, str] | None:
        """Block-relative name -> "colwise" | "rowwise"; None when TP is impossible."""
        return dict(self.tp.styles) or None

    def supports(self, dim: str) -> bool:
        return self.support.get(dim) is None

    def support_reason(self, dim: str) -> str | None:
        if dim not in DIMENSIONS:
            raise KeyError(f"unknown dimension {dim!r}; one of {', '.join(DIMENSIONS)}")
        return self.support.get(dim)
