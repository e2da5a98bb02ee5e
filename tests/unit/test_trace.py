"""The predicted timeline of ``autopar explain --trace``: schedule orders (GPipe, 1F1B, Megatron's
interleaved 1F1B), a dependency-respecting simulation whose makespan matches the cost model, and a
valid Trace Event Format file with one track per stage and M forwards and M backwards per chunk."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from autopar.cost.estimate import config_from_plan, estimate_plan
from autopar.cost.stage import build_terms
from autopar.explain.trace import Op, schedule_order, simulate, trace_json

CASES = [  # (schedule, pp, v, micro-batches)
    ("gpipe", 4, 1, 8),
    ("1f1b", 4, 1, 8),
    ("1f1b", 4, 1, 4),
    ("interleaved-1f1b", 4, 2, 8),
    ("interleaved-1f1b", 2, 4, 2),
    ("interleaved-1f1b", 4, 2, 4),
]


def _plan(make_plan, schedule, pp, v, m, **kw):
    return make_plan(16, global_batch_size=m, pp=pp, pp_schedule=schedule, pp_virtual_stages=v, **kw)


def _simulate(plan, graph, cluster):
    est = estimate_plan(plan, graph, cluster)
    terms = build_terms(graph, cluster, config_from_plan(plan))
    return est, simulate(plan, terms, est)


def test_1f1b_order_warms_up_p_minus_r_minus_1_forwards() -> None:
    order = schedule_order("1f1b", 4, 1, 6)
    assert [o.kind for o in order] == ["F", "F", "F", "B", "F", "B", "F", "B", "F", "B", "B", "B"]
    assert [o.microbatch for o in order if o.kind == "B"] == list(range(6))
    assert [o.kind for o in schedule_order("1f1b", 4, 3, 3)] == ["F", "B"] * 3  # last stage: no warm-up


def test_gpipe_order_runs_all_forwards_first() -> None:
    order = schedule_order("gpipe", 2, 1, 3)
    assert [(o.kind, o.microbatch) for o in order] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_interleaved_order_is_megatrons() -> None:
    # p = 2, v = 2, M = 4, rank 0: warm-up 2(p-r-1) + (v-1)p = 4 forwards, over chunks 0, 0, 2, 2.
    order = schedule_order("interleaved-1f1b", 2, 0, 4, 2)
    assert order[:4] == [Op(kind="F", chunk=0, microbatch=0), Op(kind="F", chunk=0, microbatch=1),
                         Op(kind="F", chunk=2, microbatch=0), Op(kind="F", chunk=2, microbatch=1)]
    assert order[4:6] == [Op(kind="F", chunk=0, microbatch=2), Op(kind="B", chunk=2, microbatch=0)]
    counts = Counter((o.kind, o.chunk) for o in order)
    assert counts == {("F", 0): 4, ("F", 2): 4, ("B", 0): 4, ("B", 2): 4}
    # rank 1 (last): warm-up (v-1)p = 2; its first backward is of chunk 3, the model's last
    order1 = schedule_order("interleaved-1f1b", 2, 1, 4, 2)
    assert [o.kind for o in order1[:4]] == ["F", "F", "F", "B"] and order1[3].chunk == 3


@pytest.mark.parametrize("schedule,pp,v,m", CASES)
def test_simulated_makespan_matches_the_cost_model(small_gpt, a100, make_plan, schedule, pp, v, m) -> None:
    plan = _plan(make_plan, schedule, pp, v, m, recompute="full")
    est, tl = _simulate(plan, small_gpt, a100)
    pipeline = est.step_time_s - max(r.tail_s for r in est.ranks)
    assert tl.pipeline_s == pytest.approx(pipeline, rel=0.03)
    assert tl.step_s == pytest.approx(est.step_time_s, rel=0.03)
    # every rank is busy exactly its micro-batch time x M; the rest is bubble
    for rk in est.ranks:
        assert tl.busy_s(rk.rank) == pytest.approx(m * rk.time_s, rel=1e-9)


@pytest.mark.parametrize("schedule,pp,v,m", CASES)
def test_simulation_respects_dependencies_and_never_overlaps(small_gpt, a100, make_plan, schedule, pp, v, m) -> None:
    plan = _plan(make_plan, schedule, pp, v, m)
    _, tl = _simulate(plan, small_gpt, a100)
    end = {}
    for e in tl.events:
        if e.category in ("forward", "backward"):
            end[(e.category[0].upper(), e.chunk, e.microbatch)] = e
    last = pp * v - 1
    for (kind, c, mb), e in end.items():
        if kind == "F" and c > 0:
            assert e.start_s >= end[("F", c - 1, mb)].end_s - 1e-12
        if kind == "B":
            dep = end[("F", c, mb)] if c == last else end[("B", c + 1, mb)]
            assert e.start_s >= dep.end_s - 1e-12
    for r in range(pp):
        evs = sorted((e for e in tl.events if e.rank == r), key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(evs, evs[1:]))


def test_the_bubble_emerges_from_the_simulation(small_gpt, a100, make_plan) -> None:
    """1F1B idles (p-1)/(M+p-1) of the pipeline time: fewer micro-batches, bigger bubble; interleaving shrinks it."""
    fractions = {}
    for schedule, v, m in (("1f1b", 1, 4), ("1f1b", 1, 16), ("interleaved-1f1b", 2, 16)):
        plan = _plan(make_plan, schedule, 4, v, m)
        est, tl = _simulate(plan, small_gpt, a100)
        fractions[(schedule, m)] = 1 - sum(tl.busy_s(r) for r in range(4)) / (4 * tl.pipeline_s)
    assert fractions[("1f1b", 4)] == pytest.approx(3 / 7, abs=0.03)
    assert fractions[("1f1b", 16)] == pytest.approx(3 / 19, abs=0.03)
    assert fractions[("interleaved-1f1b", 16)] < fractions[("1f1b", 16)] * 0.7


@pytest.mark.parametrize("schedule,pp,v,m", CASES)
def test_trace_event_format(small_gpt, a100, make_plan, schedule, pp, v, m) -> None:
    plan = _plan(make_plan, schedule, pp, v, m, recompute="selective")
    _, tl = _simulate(plan, small_gpt, a100)
    data = json.loads(json.dumps(trace_json(plan, tl)))  # plain JSON all the way down
    events = data["traceEvents"]
    assert data["displayTimeUnit"] == "ms"
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(threads) == list(range(pp)) and threads[0].startswith("stage 0")
    assert any(e["ph"] == "M" and e["name"] == "process_name" for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert e["pid"] == 0 and e["tid"] in threads
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["dur"] >= 0
        assert isinstance(e["name"], str) and e["cat"] in ("forward", "backward", "recompute", "p2p", "tail")
    assert {e["tid"] for e in spans} == set(range(pp))  # one track per stage, all used
    per_chunk = Counter((e["tid"], e["args"]["chunk"], e["cat"]) for e in spans if e["cat"] in ("forward", "backward",
                                                                                              "recompute"))
    for c in range(pp * v):
        r = c % pp
        assert per_chunk[(r, c, "forward")] == m and per_chunk[(r, c, "backward")] == m
        assert per_chunk[(r, c, "recompute")] == m  # selective recompute re-runs attention in every backward
    assert len({(e["tid"], e["args"]["microbatch"]) for e in spans if e["cat"] == "forward"}) == pp * m
    p2p = [e for e in spans if e["cat"] == "p2p"]
    assert len(p2p) == 2 * m * (pp * v - 1)  # an activation and a gradient per boundary per micro-batch


def test_single_stage_trace(small_gpt, a100, make_plan) -> None:
    plan = make_plan(16, global_batch_size=6, dp=2)
    est, tl = _simulate(plan, small_gpt, a100)
    data = trace_json(plan, tl)
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert Counter(e["cat"] for e in spans) == {"forward": 3, "backward": 3, "tail": 1}
    assert tl.step_s == pytest.approx(est.step_time_s, rel=1e-6)
