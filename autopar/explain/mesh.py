"""Which global ranks form each parallel group of a plan, and on which nodes they sit.

Ranks are laid out ``[pp, dp, cp, tp]`` row-major, tp innermost (DESIGN §3; the executor's
``executor.mesh.rank_coords`` uses the same order):

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i          node = rank // gpus_per_node

A group of an axis is the set of ranks whose other coordinates are equal. ``dp_cp`` is the group
gradients are averaged and ZeRO-sharded over (dp and cp together). The link each axis uses comes
from the cost model (``cost.comm.Mesh.link``), so the table and the estimate never disagree.

Pure arithmetic on numpy arrays: a 16,384-rank plan takes milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.cluster import Cluster
from autopar.cost.comm import Mesh
from autopar.plan import Plan

AXES = ("tp", "cp", "dp", "dp_cp", "pp")
_DIMS = ("pp", "dp", "cp", "tp")


def rank_grid(plan: Plan) -> np.ndarray:
    """Global ranks as an array of shape (pp, dp, cp, tp)."""
    p = plan.parallel
    return np.arange(p.world_size).reshape(p.pp, p.dp, p.cp, p.tp)


def axis_groups(plan: Plan, axis: str) -> np.ndarray:
    """All groups of ``axis`` as an int array (num_groups, group_size), each row ascending.

    Rows are ordered by their smallest rank. ``axis`` is one of ``AXES``.
    """
    grid = rank_grid(plan)
    if axis == "dp_cp":
        moved = np.moveaxis(grid, (1, 2), (2, 3))  # (pp, tp, dp, cp)
        rows = moved.reshape(-1, plan.parallel.dp * plan.parallel.cp)
    elif axis in _DIMS:
        k = _DIMS.index(axis)
        rows = np.moveaxis(grid, k, -1).reshape(-1, grid.shape[k])
    else:
        raise ValueError(f"unknown mesh axis {axis!r}; one of {', '.join(AXES)}")
    rows = np.sort(rows, axis=1)
    return rows[np.argsort(rows[:, 0], kind="stable")]


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
    p = plan.parallel
    mesh = Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp)
    gpn = plan.cluster.gpus_per_node
    out = []
    for axis in AXES:
        groups = axis_groups(plan, axis)
        link = mesh.link(cluster, axis)  # pp: the pair of neighbouring stages P2P runs between
        nodes = len(np.unique(groups[0] // gpn))
        out.append(AxisSummary(
            axis=axis, size=groups.shape[1], stride=mesh.stride(axis),
            groups=tuple(tuple(int(r) for r in row) for row in groups),
            nodes_per_group=nodes, link=link.link_name if groups.shape[1] > 1 else "-",
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
