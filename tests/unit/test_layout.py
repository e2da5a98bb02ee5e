"""autopar.layout: the one rank layout, its groups and links, and the degree rules."""

from __future__ import annotations

import itertools

import pytest

from autopar.layout import (
    AXES,
    DIMS,
    Coords,
    Layout,
    cp_seq_reason,
    executed_zero,
    place,
    ring_balance_reason,
    tp_heads_reason,
    tp_node_reason,
    ulysses_reason,
    world_size_reason,
)

LAYOUTS = [Layout(pp=pp, dp=dp, cp=cp, tp=tp) for pp, dp, cp, tp in itertools.product((1, 2, 3), (1, 2), (1, 2, 3), (1, 4))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "x".join(map(str, lay.shape)))
def test_coordinates_are_row_major_over_pp_dp_cp_tp_and_invert(layout: Layout) -> None:
    expected = list(itertools.product(*(range(n) for n in layout.shape)))  # row-major, tp fastest
    for rank, coords in enumerate(expected):
        c = layout.coords(rank)
        assert tuple(getattr(c, d) for d in DIMS) == coords
        assert layout.rank(c) == rank


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "x".join(map(str, lay.shape)))
def test_groups_are_the_ranks_differing_only_on_their_axis(layout: Layout) -> None:
    varying = {"pp": {"pp"}, "dp": {"dp"}, "cp": {"cp"}, "tp": {"tp"}, "dp_cp": {"dp", "cp"}}
    for axis in AXES:
        groups = layout.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))  # a partition
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)
        for g in groups:
            assert len(g) == layout.size(axis) and list(g) == sorted(g)
            assert all(b - a == layout.stride(axis) for a, b in zip(g, g[1:]))
            fixed = [d for d in DIMS if d not in varying[axis]]
            keys = {tuple(getattr(layout.coords(r), d) for d in fixed) for r in g}
            assert len(keys) == 1  # every other coordinate equal
            for r in g:
                assert layout.group(axis, r) == g


def test_strides_sizes_and_the_zero_group() -> None:
    lay = Layout(pp=4, dp=2, cp=2, tp=2)
    assert lay.shape == (4, 2, 2, 2) and lay.world_size == 32
    assert [lay.stride(a) for a in ("tp", "cp", "dp", "pp")] == [1, 2, 4, 8]
    assert lay.size("dp_cp") == 4 and lay.stride("dp_cp") == 2
    assert lay.group("dp_cp", 0) == (0, 2, 4, 6)
    assert lay.coords(13) == Coords(pp=1, dp=1, cp=0, tp=1)


def test_placement_inside_and_across_nodes() -> None:
    lay = Layout(pp=2, dp=4, cp=1, tp=4)  # 32 ranks on nodes of 8
    tp = lay.placement("tp", 8)
    assert tp.intra_node and tp.link_name == "nvlink" and tp.members_per_node == 4 and tp.nodes_per_group == 1
    dp = lay.placement("dp", 8)  # 4 ranks 4 apart: 2 per node, 2 nodes
    assert not dp.intra_node and dp.link_name == "network" and dp.members_per_node == 2 and dp.nodes_per_group == 2
    p2p = lay.p2p_placement(8)  # neighbouring stages 16 apart: different nodes, one rail each
    assert p2p.size == 2 and not p2p.intra_node and p2p.members_per_node == 1 and p2p.nodes_per_group == 2
    assert Layout(tp=2).p2p_placement(8).size == 1  # no pipeline: nothing to send
    # The node count agrees with the groups themselves.
    for axis in AXES:
        first = lay.groups(axis)[0]
        assert lay.placement(axis, 8).nodes_per_group == len({r // 8 for r in first})
    assert place(1, 64, 8).intra_node


@pytest.mark.parametrize("bad", [dict(tp=0), dict(dp=-1), dict(pp=1.5), dict(cp=True)])
def test_degrees_must_be_positive_integers(bad) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        Layout(**bad)


def test_out_of_range_ranks_and_axes_are_refused() -> None:
    lay = Layout(dp=2, tp=2)
    with pytest.raises(ValueError, match="outside"):
        lay.coords(4)
    with pytest.raises(ValueError, match="outside"):
        lay.rank(Coords(pp=0, dp=2, cp=0, tp=0))
    with pytest.raises(ValueError, match="unknown mesh axis"):
        lay.size("xp")  # ep and edp are axes: test_layout_expert.py


def test_legality_rules_give_the_reason() -> None:
    assert world_size_reason(Layout(dp=2, tp=4), 8) is None
    assert "multiply to the number of GPUs" in world_size_reason(Layout(dp=2, tp=4), 16)
    assert tp_node_reason(8, 8) is None and "inside one node" in tp_node_reason(16, 8)
    assert tp_heads_reason(4, 12, 4) is None and tp_heads_reason(1, 7, 7) is None
    assert "12 attention heads" in tp_heads_reason(8, 12, None)
    assert "2 key/value heads" in tp_heads_reason(4, 8, 2)
    assert ulysses_reason(2, 2, 8, 4) is None
    assert "tp x cp = 4" in ulysses_reason(2, 2, 8, 2)
    assert ulysses_reason(2, 2, 8, None) is None  # K/V heads repeated first (the executor)
    assert cp_seq_reason(4, 64) is None and "not divisible by cp = 3" in cp_seq_reason(3, 64)
    assert ring_balance_reason(1, 7) is None and ring_balance_reason(4, 64) is None
    assert "divisible by 8" in ring_balance_reason(4, 36)


def test_zero2_under_a_pipeline_runs_as_zero1() -> None:
    assert [executed_zero(z, 1) for z in range(4)] == [0, 1, 2, 3]
    assert [executed_zero(z, 4) for z in range(4)] == [0, 1, 1, 3]


def test_a_plan_reads_its_layout(make_plan) -> None:
    plan = make_plan(8, dp=2, tp=2, pp=2, global_batch_size=8)
    lay = plan.parallel.layout
    assert lay == Layout(pp=2, dp=2, cp=1, tp=2) and plan.parallel.world_size == lay.world_size == 8
