"""``autopar explain``: mesh groups (membership, nodes, links), stage layout, memory that sums to the
estimate, communication volume by the formulas of ``autopar.explain.volume``, summaries of huge plans."""

from __future__ import annotations

import pytest

from autopar.cost.estimate import estimate_plan
from autopar.explain.explanation import MEMORY_KEYS, elided, explain_plan, format_explanation
from autopar.explain.mesh import axis_groups, format_group, mesh_summary
from autopar.explain.volume import communication_volume, wire_factor


def _groups(plan, axis):
    return [list(map(int, g)) for g in axis_groups(plan, axis)]


def test_groups_of_dp2_tp2_pp2(make_plan) -> None:
    plan = make_plan(16, global_batch_size=8, dp=2, tp=2, pp=2)
    assert _groups(plan, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _groups(plan, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _groups(plan, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups(plan, "cp") == [[r] for r in range(8)]


def test_groups_with_context_parallelism(make_plan) -> None:
    plan = make_plan(16, global_batch_size=8, dp=2, cp=2, tp=2)
    assert _groups(plan, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _groups(plan, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups(plan, "dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_groups_agree_with_the_executor_rank_layout(make_plan) -> None:
    from autopar.executor.parallel.mesh import rank_coords

    plan = make_plan(16, global_batch_size=16, dp=2, cp=2, tp=2, pp=2)
    for axis in ("tp", "cp", "dp", "pp"):
        for group in _groups(plan, axis):
            coords = [rank_coords(r, plan) for r in group]
            others = {tuple(getattr(c, a) for a in ("pp", "dp", "cp", "tp") if a != axis) for c in coords}
            assert len(others) == 1, (axis, group)  # members differ only along their own axis
            assert sorted(getattr(c, axis) for c in coords) == list(range(len(group)))


def test_links_and_nodes_per_axis(make_plan, a100) -> None:
    plan = make_plan(16, global_batch_size=16, dp=2, tp=8, pp=2)  # 32 GPUs on 4 nodes of 8
    axes = {a.axis: a for a in mesh_summary(plan, a100)}
    assert axes["tp"].link == "nvlink" and axes["tp"].nodes_per_group == 1 and axes["tp"].num_groups == 4
    assert axes["dp"].link == "network" and axes["dp"].nodes_per_group == 2
    assert axes["dp"].groups[0] == (0, 8)
    assert axes["pp"].groups[0] == (0, 16) and axes["pp"].link == "network"
    assert format_group((0, 8), 8) == "[0, 8] @ nodes 0-1"
    assert format_group(tuple(range(0, 64, 8)), 8, max_ranks=4) == "[0, 8, ... 56] @ nodes 0-7"


def test_memory_per_stage_sums_to_the_estimate(small_gpt, a100, make_plan) -> None:
    plan = make_plan(16, global_batch_size=16, dp=2, tp=2, pp=4, zero=1, recompute="selective")
    ex = explain_plan(plan, small_gpt, a100)
    est = estimate_plan(plan, small_gpt, a100)
    assert ex.estimate.step_time_s == est.step_time_s
    for rk in ex.estimate.ranks:
        assert sum(rk.memory_bytes[k] for k in MEMORY_KEYS) == pytest.approx(rk.peak_bytes, rel=1e-12)
    assert max(rk.peak_bytes for rk in ex.estimate.ranks) == pytest.approx(est.peak_memory_bytes, rel=1e-12)
    text = format_explanation(ex)
    peak_row = max(ex.estimate.ranks, key=lambda rk: rk.peak_bytes)
    section = text.split("== memory per GPU (")[1]
    unit = {"GiB": 2**30, "MiB": 2**20}[section[:3]]
    row = next(line for line in section.splitlines() if line.startswith(f"{peak_row.rank} "))
    cells = [float(x.replace(",", "")) for x in row.split()[2:]]
    assert sum(cells[:5]) == pytest.approx(cells[5], abs=0.3)  # each rounded to 0.1
    assert cells[5] == pytest.approx(est.peak_memory_bytes / unit, abs=0.06)


def test_text_has_every_section(small_gpt, a100, make_plan) -> None:
    plan = make_plan(16, global_batch_size=8, dp=2, tp=2, pp=2)
    text = format_explanation(explain_plan(plan, small_gpt, a100))
    assert "tp groups      [0, 1] @ node 0  [2, 3] @ node 0" in text
    assert "dp groups      [0, 2] @ node 0  [1, 3] @ node 0" in text
    assert "pp groups      [0, 4] @ node 0  [1, 5] @ node 0" in text
    for word in ("pipeline stages", "embedding", "head+loss", "memory per GPU", "communication per step",
                 "all-reduce", "p2p", "nvlink", "bubble", "MFU", "time per step"):
        assert word in text, word
    stage_rows = [line for line in text.split("== pipeline stages ==")[1].split("==")[0].splitlines()
                  if line.strip()[:1].isdigit()]
    assert [row.split()[2] for row in stage_rows] == ["0-7", "8-15"]


def test_tp_and_dp_volume_follow_the_formulas(small_gpt, a100, make_plan) -> None:
    """Megatron TP: 2 all-reduces of b*s*h*d per block forward and 2 backward; DP: one all-reduce of
    the stage's gradients; PP: one activation and one gradient per micro-batch per boundary."""
    m = 4
    plan = make_plan(16, global_batch_size=2 * m, dp=2, tp=2, pp=2)
    vols = communication_volume(plan, small_gpt, a100)
    est = estimate_plan(plan, small_gpt, a100)
    x = 1 * 1024 * 1024 * 2  # b * s * h * bf16
    for v in vols:
        items = {(i.what, i.collective): i for i in v.items}
        fwd = items[("TP forward (blocks)", "all_reduce")]
        assert fwd.message_bytes == pytest.approx(x, rel=1e-6)
        assert fwd.calls_per_step == 2 * 8 * m and fwd.group_size == 2 and fwd.link == "nvlink"
        assert fwd.sent_bytes_per_step == pytest.approx(2 * 8 * m * x * wire_factor("all_reduce", 2))
        assert items[("TP backward (blocks)", "all_reduce")].calls_per_step == 2 * 8 * m
        dp = items[("DP gradient all-reduce (bucketed)", "all_reduce")]
        assert dp.message_bytes == pytest.approx(est.ranks[v.rank].params * a100.grad_reduce_bytes)  # fp32 reduce
        assert dp.calls_per_step == 1 and dp.axis == "dp_cp"
        pp = [i for i in v.items if i.axis == "pp"]
        assert sum(i.calls_per_step for i in pp) == m  # stage 0 sends activations, stage 1 gradients
    assert ("TP vocab-parallel embedding (forward)", "all_reduce") in {(i.what, i.collective) for i in vols[0].items}


def test_sp_zero3_cp_and_recompute_volume(small_gpt, a100, make_plan) -> None:
    m = 2
    plan = make_plan(16, global_batch_size=2 * m, dp=2, tp=2, cp=2, zero=3, sequence_parallel=True,
                     recompute="full", cp_kind="allgather")
    (v,) = communication_volume(plan, small_gpt, a100)
    kinds = {(i.what, i.collective): i for i in v.items}
    assert not any(i.collective == "all_reduce" and i.what.startswith("TP f") for i in v.items)
    ag = kinds[("TP forward (blocks)", "all_gather")]
    rs = kinds[("TP forward (blocks)", "reduce_scatter")]
    assert ag.calls_per_step == rs.calls_per_step == 2 * 16 * m
    assert ag.message_bytes == pytest.approx(1 * 512 * 1024 * 2, rel=1e-6)  # s / cp tokens per rank
    assert kinds[("TP forward again (full recompute)", "all_gather")].calls_per_step == 2 * 16 * m
    zero = [i for i in v.items if i.what.startswith("ZeRO-3")]
    assert len(zero) == 3 and all(i.calls_per_step == m and i.group_size == 4 for i in zero)
    cp_fwd = kinds[("CP all-gather K,V (forward)", "all_gather")]
    assert cp_fwd.calls_per_step == 16 * m * 2  # again under full recompute
    assert cp_fwd.message_bytes == pytest.approx(2 * 2 * (512 * 1024 * 2) / 2, rel=1e-6)  # cp * K,V / tp


def test_ring_cp_p2p_counts(small_gpt, a100, make_plan) -> None:
    plan = make_plan(16, global_batch_size=2, cp=4)
    (v,) = communication_volume(plan, small_gpt, a100)
    calls = {i.what: i.calls_per_step for i in v.items if i.axis == "cp"}
    # as executor/parallel/ring_attention.py: cp - 1 shifts forward; backward passes the blocks round again
    # (cp - 1) with their fp32 gradients (cp shifts, home at the owner)
    assert calls == {"CP ring K,V (forward)": 16 * 2 * 3, "CP ring K,V (backward)": 16 * 2 * 3,
                     "CP ring dK,dV (backward)": 16 * 2 * 4}


def test_huge_plans_are_summarised(small_gpt, a100, make_plan) -> None:
    plan = make_plan(16, global_batch_size=2048, dp=128, tp=8, pp=16)  # 16,384 GPUs
    text = format_explanation(explain_plan(plan, small_gpt, a100))
    assert "... 2,044 more (2,048 groups of 8)" in text
    assert "... 1,020 more (1,024 groups of 16)" in text
    assert len(text.splitlines()) < 150
    assert elided(16, keep=(7,)) == [0, 1, 2, -1, 7, -1, 14, 15]
    assert elided(5) == [0, 1, 2, 3, 4]
