"""Which global ranks form each parallel group of a plan, and on which nodes they sit.

The layout is autopar/layout.py's (the one the executor's DeviceMesh, the cost model and the
search read): ranks ``[pp, dp, cp, tp]`` row-major, tp innermost,

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i          node = rank // gpus_per_node

A group of an axis is the set of ranks whose other coordinates are equal. ``dp_cp`` is the group
gradients are averaged and ZeRO-sharded over (dp and cp together). The link each axis uses comes
from the cost model (``cost.comm.axis_link``), so the table and the estimate never disagree.

Pure arithmetic: a 16,384-rank plan takes milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.cost.comm import axis_link
from autopar.layout import AXES
from autopar.plan import Plan


def axis_groups(plan: Plan, axis: str) -> tuple[tuple[int, ...], ...]:
    """All groups of ``axis`` (one of ``AXES``), each ascending, ordered by their smallest rank."""
    return plan.parallel.layout.groups(axis)


@dataclass(frozen=True, kw_only=True)
class AxisSummary:
    """One mesh axis: its groups (all of them, as lists of global ranks) and the link it uses."""

    axis: str
    size: int  # ranks per group
    stride: int  # distance between neighbouring members in the rank order
    groups: tuple[tuple[int, ...], ...]
    nodes_per_group: int  # distinct nodes one group spans (the same for every group)
    link: str  # "nvlink" (inside a node) or "network", as the cost model costs it
    bandwidth_bytes_per_s: float

    @property
    def num_groups(self) -> int:
        return len(self.groups)


def mesh_summary(plan: Plan, cluster: Cluster) -> tuple[AxisSummary, ...]:
    """Every axis of ``plan`` (``AXES`` order), degree-1 axes included (groups of one rank)."""
    layout, gpn = plan.parallel.layout, plan.cluster.gpus_per_node
    out = []
    for axis in AXES:
        where = layout.placement(axis, gpn)
        link = axis_link(cluster, layout, axis)  # pp: the pair of neighbouring stages P2P runs between
        out.append(AxisSummary(
            axis=axis, size=where.size, stride=layout.stride(axis), groups=layout.groups(axis),
            nodes_per_group=where.nodes_per_group, link=link.link_name if where.size > 1 else "-",
            bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
        ))
    return tuple(out)


def node_of(rank: int, gpus_per_node: int) -> int:
    return rank // gpus_per_node


def format_group(group: tuple[int, ...], gpus_per_node: int, max_ranks: int = 8) -> str:
    """``[0, 2, 4, 6] @ node 0`` or ``[0, 8, ... 56] @ nodes 0-7`` (long groups elided)."""
    ranks = list(group)
    text = ", ".join(map(str, ranks)) if len(ranks) <= max_ranks else \
        ", ".join(map(str, ranks[: max_ranks - 2])) + f", ... {ranks[-1]}"
    nodes = sorted({node_of(r, gpus_per_node) for r in ranks})
    where = f"node {nodes[0]}" if len(nodes) == 1 else (
        f"nodes {nodes[0]}-{nodes[-1]}" if nodes == list(range(nodes[0], nodes[-1] + 1))
        else "nodes " + ",".join(map(str, nodes[:6])) + (",..." if len(nodes) > 6 else ""))
    return f"[{text}] @ {where}"
