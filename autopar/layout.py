"""The rank layout of a plan: its degrees, where each rank sits, the groups of each axis, the link
each group uses, and the rules that make degrees legal (the role torchtitan's ``ParallelDims`` plays).

Ranks are laid out row-major over ``DIMS = (pp, dp, cp, tp)``, tp innermost::

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i          node = rank // gpus_per_node

A group of an axis is the set of ranks whose other coordinates are equal; its members are
``stride`` apart, the product of the degrees inside it. ``dp_cp`` is the group gradients are
averaged and ZeRO-sharded over: data and context parallelism both split the tokens of a step, so
cp ranks hold the same weights as dp ranks. dp and cp are adjacent in ``DIMS``, so ``dp_cp`` is
one axis of ``dp * cp`` ranks at stride ``tp``.

Expert parallelism (``ep``) adds no dimension: it refactors the ``dp_cp`` axis as ``edp x ep``, ep
innermost (Megatron-Core's and torchtitan's layout). Flattening (dp, cp) to one index f, a rank's ep
index is f mod ep and its edp (expert data parallel) index f div ep. An ``ep`` group is ep ranks at
the stride of ``dp_cp`` that hold all E experts between them, E / ep each; an ``edp`` group is the
dp x cp / ep ranks, ep times further apart, that hold the same experts and reduce their gradients
together. The executor's expert DeviceMesh has the dimensions ``EXPERT_DIMS``, of ``expert_shape``.

Under sequence parallelism (tp > 1) the MoE layers run on each tp rank's sequence shard, so the tp
ranks too hold different tokens of the same samples: the experts' ranks are then drawn from
``dp x cp x tp`` (``folds_tp``; Megatron-Core's MoE parallel folding with expert tp 1), ep
innermost -- across the tp ranks first, so an ep group of tp x k ranks stays inside a node where
tp does. The pool the expert axes split is the ``moe_dp`` axis (dp x cp, or dp x cp x tp when
folded): what a MoE layer's replicated parameters (its router, an unsharded shared expert) are
data-parallel over.

The search (search/space.py), the cost model (cost/comm.py, cost/expert.py), explain (explain/mesh.py,
explain/volume.py) and the executor's DeviceMeshes (executor/parallel/mesh.py,
executor/parallel/expert_parallel.py) all read this one object; the legality rules below are the
only copy of each rule. Pure Python, no torch: the planner plans 16,384 GPUs on a laptop.

A new mesh dimension is a field of ``Layout`` and of ``Coords`` and its name in ``DIMS`` at its
place in the order: shape, world size, strides, coordinates and groups all follow from ``DIMS``. An
axis made of adjacent dimensions (like ``dp_cp``), or a split of one (``ep`` and ``edp``), is named
in ``size`` and ``stride``; groups and placements follow from those two.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DIMS = ("pp", "dp", "cp", "tp")  # outermost to innermost: the DeviceMesh's dimension order
AXES = ("tp", "cp", "dp", "dp_cp", "pp")  # every axis a group runs on, innermost first (explain's order)
EXPERT_AXES = ("ep", "edp", "moe_dp")  # expert parallelism: moe_dp refactored as edp x ep, ep innermost
EXPERT_DIMS = ("pp", "edp", "ep", "tp")  # the expert DeviceMesh's dimension order (expert_shape)


@dataclass(frozen=True, kw_only=True)
class Coords:
    """One rank's coordinate on each mesh dimension."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the groups of one axis sit on nodes of ``gpus_per_node`` GPUs.

    ``members_per_node`` and ``intra_node`` follow the cost model's rule: a group whose span
    (``stride * size`` consecutive ranks) fits in a node runs inside one, otherwise it has
    ``min(size, gpus_per_node // stride)`` members in each node it spans (exact whenever the span
    and the node size divide one another, as with power-of-two degrees). ``nodes_per_group`` is
    counted on the first group."""

    size: int  # ranks per group
    stride: int  # distance between neighbouring members in the rank order
    members_per_node: int
    nodes_per_group: int
    intra_node: bool

    def __post_init__(self) -> None:
        if min(self.size, self.stride, self.members_per_node, self.nodes_per_group) < 1:
            raise ValueError(f"a placement's counts must be >= 1: {self}")

    @property
    def link_name(self) -> str:
        """``nvlink`` inside a node (NVLink / NVSwitch), ``network`` across nodes."""
        return "nvlink" if self.intra_node else "network"


def place(size: int, stride: int, gpus_per_node: int) -> Placement:
    """The placement of groups of ``size`` ranks ``stride`` apart (see ``Placement``)."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    # Nodes the first group touches: a step shorter than a node visits every node on the way.
    nodes = size if stride >= gpus_per_node else ((size - 1) * stride) // gpus_per_node + 1
    if size <= 1:
        return Placement(size=1, stride=max(1, stride), members_per_node=1, nodes_per_group=1, intra_node=True)
    if stride * size <= gpus_per_node:
        return Placement(size=size, stride=stride, members_per_node=size, nodes_per_group=nodes, intra_node=True)
    members = max(1, min(size, gpus_per_node // max(1, stride)))
    return Placement(size=size, stride=stride, members_per_node=members, nodes_per_group=nodes, intra_node=False)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The degrees of a plan and the ``[pp, dp, cp, tp]`` rank layout they make (module docstring).
    ``ep`` is no dimension of that layout: it splits the ``dp_cp`` axis into the ``ep`` and ``edp``
    axes (``EXPERT_AXES``), whose sizes and strides raise ValueError unless ep divides dp x cp."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism: ranks of dp x cp an MoE block's experts are sharded over
    # sequence parallelism at tp > 1: MoE layers run on sequence shards and the expert axes split
    # dp x cp x tp (module docstring)
    folds_tp: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "folds_tp":
                if not isinstance(value, bool):
                    raise ValueError(f"folds_tp must be a bool, got {value!r}")
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"the {f.name} degree must be a positive integer, got {value!r}")

    @classmethod
    def of(cls, degrees: object) -> Layout:
        """The layout of anything with ``pp``, ``dp``, ``cp`` and ``tp`` attributes, and ``ep`` where
        it has one (a plan's ``parallel`` section, the cost model's ``Config``)."""
        tp = degrees.tp
        folds = bool(getattr(degrees, "sequence_parallel", False)) and tp > 1
        return cls(**{d: getattr(degrees, d) for d in DIMS}, ep=getattr(degrees, "ep", 1), folds_tp=folds)

    @property
    def expert_shape(self) -> tuple[int, ...]:
        """The degrees in ``EXPERT_DIMS`` order: the shape of the executor's expert DeviceMesh, the
        ``DIMS`` shape with dp x cp refactored as edp x ep (the same ranks in the same order); folded,
        dp x cp x tp refactored so, and the mesh's tp dimension of size 1."""
        if self.folds_tp:
            return (self.pp, self.size("edp"), self.ep, 1)
        return tuple(getattr(self, d) if d in DIMS else self.size(d) for d in EXPERT_DIMS)

    @property
    def shape(self) -> tuple[int, ...]:
        """The degrees in ``DIMS`` order (the DeviceMesh's shape)."""
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def world_size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def size(self, axis: str) -> int:
        """Ranks in one group of ``axis`` (one of ``AXES`` or ``EXPERT_AXES``)."""
        if axis == "dp_cp":
            return self.dp * self.cp
        if axis in EXPERT_AXES:
            self._check_experts()
            pool = moe_pool(self.dp, self.cp, self.tp, self.folds_tp)
            return {"ep": self.ep, "edp": pool // self.ep, "moe_dp": pool}[axis]
        _check_axis(axis)
        return getattr(self, axis)

    def stride(self, axis: str) -> int:
        """Distance in the rank order between neighbouring members of a group of ``axis``."""
        if axis in EXPERT_AXES:  # ep innermost of moe_dp, edp outside it
            self._check_experts()
            return (1 if self.folds_tp else self.stride("dp_cp")) * (self.ep if axis == "edp" else 1)
        inner = DIMS[DIMS.index("cp" if axis == "dp_cp" else _check_axis(axis)) + 1:]
        out = 1
        for d in inner:
            out *= getattr(self, d)
        return out

    def coords(self, rank: int) -> Coords:
        """Coordinates of global ``rank`` (row-major over ``DIMS``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        out = {}
        for d in reversed(DIMS):
            rank, out[d] = divmod(rank, getattr(self, d))
        return Coords(**out)

    def rank(self, coords: Coords) -> int:
        """The global rank at ``coords`` (inverse of ``coords``)."""
        out = 0
        for d in DIMS:
            c, n = getattr(coords, d), getattr(self, d)
            if not 0 <= c < n:
                raise ValueError(f"coordinate {d} = {c} is outside the degree {n}")
            out = out * n + c
        return out

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``axis``, ascending."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        size, stride = self.size(axis), self.stride(axis)
        span = size * stride  # the group's members lie inside one block of ``span`` consecutive ranks
        first = rank - rank % span + rank % stride
        return tuple(first + i * stride for i in range(size))

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every group of ``axis``, each ascending, ordered by their smallest rank."""
        size, stride = self.size(axis), self.stride(axis)
        span = size * stride
        return tuple(tuple(block + offset + i * stride for i in range(size))
                     for block in range(0, self.world_size, span) for offset in range(stride))

    def placement(self, axis: str, gpus_per_node: int) -> Placement:
        """Where the groups of ``axis`` sit on nodes of ``gpus_per_node`` GPUs."""
        return place(self.size(axis), self.stride(axis), gpus_per_node)

    def p2p_placement(self, gpus_per_node: int) -> Placement:
        """The pair of neighbouring pipeline stages a point-to-point send runs between (a group of
        one rank when there is no pipeline)."""
        return place(2 if self.pp > 1 else 1, self.stride("pp"), gpus_per_node)

    def expert_reason(self, num_experts: int | None) -> str | None:
        """``ep_reason`` of this layout's ep over its pool (``moe_pool``), for ``num_experts`` experts
        (None: not known here)."""
        return ep_reason(self.ep, moe_pool(self.dp, self.cp, self.tp, self.folds_tp), num_experts,
                         folds_tp=self.folds_tp)

    def _check_experts(self) -> None:
        """The expert axes exist only where ep divides their pool (``ep_reason``)."""
        reason = self.expert_reason(None)
        if reason:
            raise ValueError(reason)


def _check_axis(axis: str) -> str:
    if axis not in DIMS:
        raise ValueError(f"unknown mesh axis {axis!r}; one of {', '.join(AXES + EXPERT_AXES)}")
    return axis


# ---------------------------------------------------------------------------------------------
# Legality: each rule once, as the reason a choice is illegal (None when it is legal). The plan
# file's checks (plan.py), the search's space (search/space.py), the estimate (cost/estimate.py,
# cost/expert.py), the model graph (graph/model_graph.py) and the executor's preflight
# (executor/runtime/checks.py, executor/parallel/expert_parallel.py) call these.


def world_size_reason(layout: Layout, num_gpus: int) -> str | None:
    """The degrees multiply to the number of GPUs."""
    if layout.world_size == num_gpus:
        return None
    return (f"dp x tp x pp x cp = {layout.dp}x{layout.tp}x{layout.pp}x{layout.cp} = {layout.world_size} "
            f"but cluster.num_gpus = {num_gpus}; the degrees must multiply to the number of GPUs")


def tp_node_reason(tp: int, gpus_per_node: int) -> str | None:
    """Tensor parallelism stays inside a node (its collectives run every layer, on NVLink)."""
    if tp <= gpus_per_node:
        return None
    return (f"parallel.tp = {tp} exceeds cluster.gpus_per_node = {gpus_per_node}; "
            "tensor parallelism must stay inside one node")


def tp_heads_reason(tp: int, num_heads: int | None, num_kv_heads: int | None) -> str | None:
    """tp divides the attention heads and the key/value heads (each rank holds whole heads)."""
    if tp == 1:
        return None
    for what, n in (("attention heads", num_heads), ("key/value heads", num_kv_heads)):
        if n is not None and n % tp:
            return f"tp = {tp} does not divide the model's {n} {what}; pick a tp that divides {n}"
    return None


@dataclass(frozen=True, kw_only=True)
class TPDegrees:
    """What decides, degree by degree, whether tensor parallelism runs on a model: the one predicate
    the search, ``autopar estimate`` and the executor's preflight ask (``reason``).

    A degree must divide the heads and key/value heads (``tp_heads_reason``) and the width of every
    planned layer (``widths``: layer name -> the width tp splits; colwise its outputs, rowwise its
    inputs). The code a block runs can ask more of a rank's width than a shape rule sees (CodeGen
    reshapes its fused qkv into ``mp_num = 4`` groups of whole heads: at 2 heads a rank it fails),
    so every degree the rules allow was also run, block 0 (a chain: one unit of each kind) at one
    rank's width on meta
    (spec/tp_degree.py), and ``refused`` holds those that failed, with why. Only divisors of the
    heads and widths pass the rules, so every degree ``reason`` can say None to has been run."""

    num_heads: int | None = None
    num_kv_heads: int | None = None
    widths: tuple[tuple[str, int], ...] = ()
    refused: tuple[tuple[int, str], ...] = ()

    def rule_reason(self, tp: int) -> str | None:
        """Why ``tp`` breaks a shape rule (heads, widths), None if it keeps them all."""
        if tp == 1:
            return None
        why = tp_heads_reason(tp, self.num_heads, self.num_kv_heads)
        if why:
            return why
        for name, width in self.widths:
            if width % tp:
                return f"tp = {tp} does not divide the width {width} of {name}; pick another tp"
        return None

    def reason(self, tp: int) -> str | None:
        """None if degree ``tp`` runs on the model, else one line saying why not."""
        return self.rule_reason(tp) or dict(self.refused).get(tp)

    def candidates(self) -> tuple[int, ...]:
        """The degrees > 1 that keep every shape rule (what the meta check runs): the divisors of the
        heads' and widths' greatest common divisor; none where neither heads nor widths are known."""
        import math

        sizes = [n for n in (self.num_heads, self.num_kv_heads) if n] + [w for _, w in self.widths]
        if not sizes:
            return ()
        g = math.gcd(*sizes)
        return tuple(d for d in range(2, g + 1) if g % d == 0 and self.rule_reason(d) is None)


def ulysses_reason(tp: int, cp: int, num_heads: int | None, num_kv_heads: int | None) -> str | None:
    """Ulysses trades the sequence for heads: tp x cp divides the heads (and, as the cost model
    prices it, the key/value heads; pass None where K/V heads are repeated first)."""
    for what, n in (("attention heads", num_heads), ("key/value heads", num_kv_heads)):
        if n is not None and n % (tp * cp):
            return (f"Ulysses needs tp x cp = {tp * cp} to divide the model's {n} {what}; "
                    "use cp_kind ring or allgather")
    return None


def cp_seq_reason(cp: int, seq_len: int) -> str | None:
    """Context parallelism splits the sequence into cp equal shards."""
    if seq_len % cp:
        return f"training.seq_len = {seq_len} is not divisible by cp = {cp}"
    return None


def ring_balance_reason(cp: int, seq_len: int) -> str | None:
    """Ring attention as the cost model prices it splits the sequence into 2 x cp chunks, each rank
    holding one early and one late chunk (causal load balance; executor/parallel/context_parallel.py)."""
    if cp > 1 and seq_len % (2 * cp):
        return (f"ring attention balances causal work with 2 x cp chunks: seq_len {seq_len} "
                f"must be divisible by {2 * cp}")
    return None


def moe_pool(dp: int, cp: int, tp: int, folds_tp: bool) -> int:
    """The ranks an MoE layer's experts are drawn from (the ``moe_dp`` axis): dp x cp, and the tp
    ranks too under sequence parallelism (``folds_tp``: module docstring)."""
    return dp * cp * (tp if folds_tp else 1)


def ep_reason(ep: int, pool: int, num_experts: int | None, *, folds_tp: bool = False) -> str | None:
    """Expert parallelism shards whole experts: ep divides the model's ``num_experts`` (None: not
    known here), and its ep ranks are drawn from the ``pool`` = dp x cp ranks (dp x cp x tp under
    sequence parallelism: ``folds_tp``, ``Layout.size("moe_dp")``), so ep divides the pool. What the
    model itself must have for any ep > 1 is spec/support.py's ``ep`` predicate."""
    if ep == 1:
        return None
    if num_experts is not None and num_experts % ep:
        return f"ep = {ep} does not divide the model's {num_experts} experts; pick an ep that divides {num_experts}"
    if pool % ep:
        what = "dp x cp x tp (sequence parallelism)" if folds_tp else "dp x cp"
        return f"ep = {ep} does not divide {what} = {pool}; pick an ep that divides {pool}"
    return None


def executed_zero(zero: int, pp: int) -> int:
    """The ZeRO stage the executor runs for ``zero`` at pipeline depth ``pp``: ZeRO-2 at pp > 1 runs
    as ZeRO-1 (torch.distributed.pipelining's stage defers an FSDP module's gradient sync to the
    step's last backward and keeps its parameters gathered; cost/zero.py). It is priced, explained
    and searched as what runs."""
    return 1 if zero == 2 and pp > 1 else zero
