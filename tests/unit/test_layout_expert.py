"""autopar.layout's expert axes: the ep and edp groups the cost model and explain price are the
groups the executor's expert DeviceMesh makes, and ep's rules are one predicate."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from autopar.layout import DIMS, EXPERT_AXES, EXPERT_DIMS, Layout, ep_reason

# (pp, dp, cp, tp, ep): ep inside one dp, spanning dp and cp, all of dp x cp, and at ep = 1
DEGREES = [(1, 4, 1, 2, 2), (2, 4, 2, 2, 4), (1, 2, 3, 1, 3), (2, 4, 2, 1, 8), (1, 8, 1, 2, 1), (3, 2, 2, 2, 2)]
LAYOUTS = [Layout(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep) for pp, dp, cp, tp, ep in DEGREES]


def _ids(lay: Layout) -> str:
    return "x".join(map(str, lay.shape)) + f"-ep{lay.ep}"


def _flat(lay: Layout, rank: int) -> int:
    """The rank's index f on the flattened (dp, cp) axis."""
    c = lay.coords(rank)
    return c.dp * lay.cp + c.cp


@pytest.mark.parametrize("lay", LAYOUTS, ids=_ids)
def test_ep_is_innermost_of_dp_cp_and_edp_holds_the_same_experts(lay: Layout) -> None:
    n = lay.world_size
    assert lay.groups("moe_dp") == lay.groups("dp_cp")  # without SP the pool is dp x cp
    for axis in ("ep", "edp"):
        groups = lay.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(n))  # a partition
        for g in groups:
            assert len(g) == lay.size(axis) and all(b - a == lay.stride(axis) for a, b in zip(g, g[1:]))
            assert {(lay.coords(r).pp, lay.coords(r).tp) for r in g} == {(lay.coords(g[0]).pp, lay.coords(g[0]).tp)}
            # an ep group: the same edp index f div ep; an edp group: the same ep index f mod ep
            same = (lambda r: _flat(lay, r) // lay.ep) if axis == "ep" else (lambda r: _flat(lay, r) % lay.ep)
            assert len({same(r) for r in g}) == 1
            for r in g:
                assert lay.group(axis, r) == g
    assert lay.size("ep") * lay.size("edp") == lay.size("dp_cp")
    for r in range(n):  # the ep and edp groups of a rank split its dp x cp group
        assert set(lay.group("ep", r)) | set(lay.group("edp", r)) <= set(lay.group("dp_cp", r))
        assert set(lay.group("ep", r)) & set(lay.group("edp", r)) == {r}


@pytest.mark.parametrize("lay", LAYOUTS, ids=_ids)
def test_expert_shape_lays_the_same_ranks_in_the_same_order(lay: Layout) -> None:
    assert EXPERT_DIMS[0] == DIMS[0] and EXPERT_DIMS[-1] == DIMS[-1]
    ranks = torch.arange(lay.world_size).reshape(lay.expert_shape)
    for i, axis in enumerate(EXPERT_DIMS):
        if axis in EXPERT_AXES:
            along = ranks.movedim(i, -1).reshape(-1, lay.size(axis))
            assert sorted(tuple(g) for g in along.tolist()) == sorted(lay.groups(axis))


def _powers_of_two(lay: Layout) -> bool:
    return all(n & (n - 1) == 0 for n in (*lay.shape, lay.ep))


@pytest.mark.parametrize("lay", [lay for lay in LAYOUTS if _powers_of_two(lay)], ids=_ids)
def test_expert_placement_counts_the_nodes_of_the_groups(lay: Layout) -> None:
    # exact where spans and nodes divide one another (layout.Placement), as with powers of two
    for axis in EXPERT_AXES:
        first = lay.groups(axis)[0]
        p = lay.placement(axis, 4)
        assert p.nodes_per_group == len({r // 4 for r in first})
        assert p.intra_node == all(len({r // 4 for r in g}) == 1 for g in lay.groups(axis))


@pytest.mark.parametrize("lay", [lay for lay in LAYOUTS if lay.world_size <= 32], ids=_ids)
def test_the_executors_device_mesh_makes_the_layouts_expert_groups(lay: Layout) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.executor.parallel.expert_parallel import expert_groups

    plan = SimpleNamespace(parallel=SimpleNamespace(layout=lay))
    spec = SimpleNamespace(moe=SimpleNamespace(num_experts=8 * lay.ep))
    for rank in sorted({0, 1, lay.world_size // 2 + 1, lay.world_size - 1}):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world_size)
        try:
            groups = expert_groups(plan, spec, torch.device("cpu"))
            assert tuple(groups.mesh["ep"].mesh.tolist()) == lay.group("ep", rank)
            assert tuple(groups.mesh["edp"].mesh.tolist()) == lay.group("edp", rank)
            assert (groups.ep, groups.edp, groups.grad_divide) == (lay.size("ep"), lay.size("edp"), lay.size("dp_cp"))
            assert groups.ep_rank == lay.group("ep", rank).index(rank)
        finally:
            dist.destroy_process_group()


def test_ep_reason_is_the_one_rule_and_the_axes_refuse_an_illegal_ep() -> None:
    assert ep_reason(1, 3, 5) is None and ep_reason(4, 8, 64) is None and ep_reason(4, 8, None) is None
    assert ep_reason(8, 8, 4) == "ep = 8 does not divide the model's 4 experts; pick an ep that divides 4"
    assert ep_reason(4, 6, 8) == "ep = 4 does not divide dp x cp = 6; pick an ep that divides 6"
    assert ep_reason(3, 8, 64).startswith("ep = 3 does not divide the model's 64 experts")  # experts said first
    bad = Layout(dp=3, cp=2, ep=4)
    assert bad.world_size == 6 and bad.size("dp_cp") == 6  # the [pp, dp, cp, tp] layout stands
    for axis, ask in itertools.product(EXPERT_AXES, ("size", "stride")):
        with pytest.raises(ValueError, match="does not divide dp x cp = 6"):
            getattr(bad, ask)(axis)
    with pytest.raises(ValueError, match="unknown mesh axis 'xp'; one of .*ep, edp"):
        Layout().size("xp")


def test_of_reads_ep_where_the_degrees_have_one() -> None:
    assert Layout.of(SimpleNamespace(pp=1, dp=4, cp=2, tp=2, ep=4)).size("edp") == 2
    assert Layout.of(SimpleNamespace(pp=1, dp=4, cp=2, tp=2)).ep == 1
    with pytest.raises(ValueError, match="the ep degree must be a positive integer"):
        Layout(ep=0)


# (pp, dp, cp, tp, ep) under sequence parallelism: ep inside the tp ranks, across tp and dp, all of them
FOLDED = [Layout(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, folds_tp=True)
          for pp, dp, cp, tp, ep in [(1, 2, 1, 2, 2), (1, 2, 1, 2, 4), (2, 4, 1, 2, 8), (1, 2, 2, 2, 4), (1, 4, 1, 2, 1)]]


@pytest.mark.parametrize("lay", FOLDED, ids=_ids)
def test_under_sp_the_expert_axes_split_dp_cp_tp_tp_first(lay: Layout) -> None:
    """Megatron-Core's MoE parallel folding: an ep group is ep consecutive ranks of one pipeline
    stage (the tp ranks first), an edp group the ranks of the stage with the same ep index, and
    moe_dp every rank of the stage."""
    stage = lay.world_size // lay.pp
    assert lay.size("moe_dp") == lay.dp * lay.cp * lay.tp == stage
    assert lay.size("ep") * lay.size("edp") == stage
    for r in range(lay.world_size):
        f = r % stage  # the rank's index on the flattened (dp, cp, tp) axis
        ep_group, edp_group = lay.group("ep", r), lay.group("edp", r)
        assert ep_group == tuple(r - f % lay.ep + i for i in range(lay.ep))
        assert all(g % stage % lay.ep == f % lay.ep and g // stage == r // stage for g in edp_group)
        assert lay.group("moe_dp", r) == tuple(range(r - f, r - f + stage))
    ranks = torch.arange(lay.world_size).reshape(lay.expert_shape)  # the executor's expert mesh
    for i, axis in ((1, "edp"), (2, "ep")):
        along = ranks.movedim(i, -1).reshape(-1, lay.size(axis))
        assert sorted(tuple(g) for g in along.tolist()) == sorted(lay.groups(axis))


def test_sp_draws_ep_from_the_tp_ranks_too() -> None:
    sp = SimpleNamespace(pp=1, dp=2, cp=1, tp=4, ep=8, sequence_parallel=True)
    assert Layout.of(sp).folds_tp and Layout.of(sp).size("edp") == 1
    assert not Layout.of(SimpleNamespace(pp=1, dp=8, cp=1, tp=1, ep=8, sequence_parallel=True)).folds_tp  # tp 1
    assert ep_reason(8, 8, 64, folds_tp=True) is None
    assert ep_reason(16, 8, 64, folds_tp=True) == ("ep = 16 does not divide dp x cp x tp (sequence parallelism) = 8; "
                                                   "pick an ep that divides 8")
    with pytest.raises(ValueError, match="does not divide dp x cp = 2"):
        Layout.of(SimpleNamespace(pp=1, dp=2, cp=1, tp=4, ep=8, sequence_parallel=False)).size("ep")


@pytest.mark.parametrize("lay", FOLDED, ids=_ids)
def test_the_executors_folded_meshes_make_the_layouts_groups(lay: Layout) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.executor.parallel.expert_parallel import expert_groups

    plan = SimpleNamespace(parallel=SimpleNamespace(layout=lay))
    spec = SimpleNamespace(moe=SimpleNamespace(num_experts=8 * lay.ep))
    for rank in sorted({0, 1, lay.world_size - 1}):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world_size)
        try:
            groups = expert_groups(plan, spec, torch.device("cpu"))
            assert tuple(groups.mesh["ep"].mesh.tolist()) == lay.group("ep", rank)
            assert tuple(groups.mesh["edp"].mesh.tolist()) == lay.group("edp", rank)
            assert tuple(groups.pool_mesh.mesh.tolist()) == lay.group("moe_dp", rank)
            assert groups.grad_divide == lay.dp * lay.cp  # the tp ranks hold other tokens of the same samples
        finally:
            dist.destroy_process_group()
