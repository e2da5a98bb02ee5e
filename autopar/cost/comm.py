"""Alpha-beta cost of collectives on a mesh axis, on the link that axis really uses.

Ranks are laid out [pp, dp, cp, tp], outermost to innermost (autopar/layout.py: which ranks form a
group, and how its ``n`` members at ``stride`` sit on nodes, ``k = min(n, gpus_per_node // stride)``
per node). A group inside one node runs on NVSwitch; a group spanning nodes runs ring algorithms
whose inter-node hops each ride one NIC rail, so it gets k rails: bandwidth ``min(intra, k * inter)``
(a node's k members share what crosses the network: each byte enters a node once and is passed on
over NVLink -- the ~192 GB/s all-reduce bus bandwidth of DGX A100 nodes with 8 x 25 GB/s rails).
An all-to-all cannot share that way: every byte has its own destination, so the (n - k)/n of a
rank's message bound for other nodes leaves through that rank's own rail (PXN only moves it to the
rail-matched GPU first; the other groups of the axis use the node's other rails at the same time),
while the (k - 1)/n for its node's members go over NVLink alongside. Its time is the slower of the
two, ``(n - k)/n M / inter`` in practice: a bus bandwidth of ``inter (n - 1)/(n - k)``, close to one
rail's, as nccl-tests' alltoall_perf shows across nodes.

Times use the bus-bandwidth convention of nccl-tests, with ``M`` the full tensor size in bytes:

    all-reduce        2 (n-1)/n * M / bw + 2 (n-1) * latency
    all-gather / reduce-scatter / all-to-all
                        (n-1)/n * M / bw +   (n-1) * latency
    point-to-point              M / bw +           latency

where bw is the link bandwidth times its efficiency at the per-step message size; so a ring's
latency grows with its length (at dp 512 an all-gather pays 511 hops). An all-reduce across nodes
takes the cheaper of the ring and NCCL's tree (2 log2(nodes) network hops; ``_tree_all_reduce_s``);
one inside an NVSwitch node with in-switch reduction (``nvls_bandwidth_bytes_per_s``, H100) runs as
NVLS at that bus bandwidth. A link measured
by ``autopar profile --comm`` carries a fit (latency, bus bandwidth) per collective, found by
the least total relative error on the same formula (autopar.profiler.comm.fit_collective);
that collective then uses its own fit (bandwidth scaled like the link's for groups that span
nodes) and no efficiency curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cluster import Cluster, Link
from autopar.cost.memo import IdentityMemo
from autopar.layout import Layout, Placement, place

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True, kw_only=True)
class GroupLink:
    """How a group of ranks communicates: size, members per node and the resulting bandwidth."""

    size: int
    members_per_node: int
    intra_node: bool
    bandwidth_bytes_per_s: float
    link: Link

    @property
    def link_name(self) -> str:
        return "nvlink" if self.intra_node else "network"


def placement_link(cluster: Cluster, where: Placement) -> GroupLink:
    """The link a group placed as ``where`` uses on ``cluster`` (module docstring)."""
    if where.intra_node:
        return GroupLink(size=where.size, members_per_node=where.members_per_node, intra_node=True,
                         bandwidth_bytes_per_s=cluster.intra_node.bandwidth_bytes_per_s, link=cluster.intra_node)
    k = where.members_per_node
    bw = min(cluster.intra_node.bandwidth_bytes_per_s, k * cluster.inter_node.bandwidth_bytes_per_s)
    return GroupLink(size=where.size, members_per_node=k, intra_node=False, bandwidth_bytes_per_s=bw,
                     link=cluster.inter_node)


def group_link(cluster: Cluster, size: int, stride: int) -> GroupLink:
    """The link used by a group of ``size`` ranks spaced ``stride`` apart in the rank order."""
    return placement_link(cluster, place(size, stride, cluster.gpus_per_node))


def axis_link(cluster: Cluster, layout: Layout, axis: str) -> GroupLink:
    """The link of the groups of ``axis`` (``layout.AXES``; ``dp_cp`` is the ZeRO/gradient group).
    For ``pp`` it is the link between neighbouring stages, which is what a P2P send crosses."""
    # The search asks this for the same few layouts thousands of times: remembered per cluster object.
    g = cluster.gpus_per_node
    return _AXIS_LINKS.get((cluster,), (layout.pp, layout.dp, layout.cp, layout.tp, layout.ep, axis), lambda: placement_link(
        cluster, layout.p2p_placement(g) if axis == "pp" else layout.placement(axis, g)))


_AXIS_LINKS: IdentityMemo[GroupLink] = IdentityMemo(65536)


def collective_time_s(kind: str, message_bytes: float, group: GroupLink) -> float:
    """Time of one collective of ``message_bytes`` (the full, unsharded tensor) over ``group``."""
    n = group.size
    if n <= 1 or message_bytes <= 0:
        return 0.0
    if kind == "all_reduce":
        volume, hops = 2.0 * (n - 1) / n * message_bytes, 2 * (n - 1)
    elif kind in ("all_gather", "reduce_scatter", "all_to_all"):
        volume, hops = (n - 1) / n * message_bytes, n - 1
    elif kind == "p2p":
        volume, hops = message_bytes, 1
    else:
        raise ValueError(f"unknown collective {kind!r}; one of {COLLECTIVES}")
    group_bw = _all_to_all_bandwidth(group) if kind == "all_to_all" else group.bandwidth_bytes_per_s
    fit = group.link.fit(kind)
    if fit is not None:
        latency, bandwidth = fit
        bw = bandwidth * group_bw / group.link.bandwidth_bytes_per_s
        return volume / bw + hops * latency + group.link.rendezvous_s
    step_bytes = message_bytes / n if kind != "p2p" else message_bytes
    bw = group_bw * group.link.efficiency(step_bytes)
    if kind == "all_reduce" and group.intra_node and n > 2 and group.link.nvls_bandwidth_bytes_per_s > 0:
        # NVLS: the switch reduces; bus bandwidth beyond the ring's, latency of one pass each way.
        bw = group.link.nvls_bandwidth_bytes_per_s * group.link.efficiency(step_bytes)
        return volume / bw + 2 * group.link.latency_s + group.link.rendezvous_s
    ring = volume / bw + hops * group.link.latency_s + group.link.rendezvous_s
    if kind == "all_reduce" and not group.intra_node:
        return min(ring, _tree_all_reduce_s(message_bytes, group))
    return ring


def _all_to_all_bandwidth(group: GroupLink) -> float:
    """Bus bandwidth of an all-to-all over ``group`` (module docstring): the ring figure inside a
    node; across nodes each rank's own rail carries its (n - k)/n bound for other nodes."""
    n, k = group.size, group.members_per_node
    if group.intra_node or n <= k:
        return group.bandwidth_bytes_per_s
    rail = group.link.bandwidth_bytes_per_s  # one NIC per GPU (cluster.inter_node)
    return min(group.bandwidth_bytes_per_s, rail * (n - 1) / (n - k))


def _tree_all_reduce_s(message_bytes: float, group: GroupLink) -> float:
    """NCCL's tree all-reduce across nodes (what it picks where the ring's 2(n-1) latency hops
    dominate): a reduce up and a broadcast down a binary tree of the nodes, pipelined in chunks, so
    the volume is the ring's 2 M per rank at the same per-GPU rail bandwidth and the latency is
    2 log2(nodes) network hops plus 2 (k - 1) hops inside each node."""
    nodes = max(1, group.size // max(1, group.members_per_node))
    if nodes <= 1:
        return math.inf
    k = group.members_per_node
    bw = group.bandwidth_bytes_per_s * group.link.efficiency(message_bytes / max(1, k))
    hops = 2 * math.ceil(math.log2(nodes)) + 2 * (k - 1)
    return 2.0 * message_bytes / bw + hops * group.link.latency_s + group.link.rendezvous_s
