"""The values a pipeline stage receives beside the hidden state (carried prologue outputs: an
encoder's output every decoder block attends to, a bias passed as a keyword argument): measured
on meta by the executor's own probe, fitted in batch and sequence, and priced in the pipeline's
point-to-point time and every receiving stage's buffers. A model without them prices as before."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

from autopar.cluster import load_cluster
from autopar.cost.comm import axis_link, collective_time_s
from autopar.cost.estimate import config_from_plan
from autopar.cost.stage import build_terms
from autopar.cost.step import evaluate
from autopar.explain.explanation import explain_plan, format_explanation
from autopar.graph.measure import build_graph
from autopar.layout import Layout
from autopar.plan import plan_from_dict

TESTS = Path(__file__).resolve().parents[1]
ENCODER = TESTS / "data" / "models" / "encoder_memory.py"
VIT = TESTS / "dist" / "models" / "bare_params_vit.py"
SEQ_LEN, ENC = 32, 256  # encoder_memory.py


@functools.lru_cache(maxsize=None)
def _graph(carry: bool = True, dtype: str = "bf16"):
    if carry:
        return build_graph(str(ENCODER), dtype=dtype)
    return build_graph(str(_twin()), dtype=dtype)


@functools.lru_cache(maxsize=None)
def _twin() -> Path:
    """encoder_memory.py with the encoder's output joining the hidden state (nothing carried)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="autopar_twin_")) / "encoder_memory_twin.py"
    path.write_text(ENCODER.read_text().replace("CARRY = True", "CARRY = False"))
    return path


def _plan(*, pp: int = 2, tp: int = 1, sp: bool = False, micro_batch: int = 4, global_batch: int = 16,
          dtype: str = "fp32"):
    per = 4 // pp
    stages = [[i * per, (i + 1) * per] for i in range(pp)]
    return plan_from_dict({
        "version": 1,
        "model": {"file": str(ENCODER), "num_blocks": 4},
        "cluster": {"profile": "h100-80g", "num_gpus": pp * tp, "gpus_per_node": 8},
        "training": {"global_batch_size": global_batch, "micro_batch_size": micro_batch, "seq_len": SEQ_LEN,
                     "dtype": dtype, "optimizer": "adam"},
        "parallel": {"dp": 1, "tp": tp, "pp": pp, "cp": 1, "sequence_parallel": sp, "zero": 0,
                     "recompute": "none", "pp_schedule": "1f1b", "stages": stages},
    })


def test_the_encoder_output_every_block_reads_is_recorded_with_its_batch_and_sequence_scaling() -> None:
    graph = _graph()
    (q,) = graph.carried
    assert q.what == "encoder" and q.nbytes == SEQ_LEN * ENC * 2  # one sample, bf16
    assert (q.exps.b, q.exps.s, q.exps.t) == (1.0, 1.0, 0.0)
    assert graph.carried_bytes(4, 0.5) == 4 * (SEQ_LEN // 2) * ENC * 2


def test_a_bias_passed_to_every_block_is_carried_whatever_the_batch() -> None:
    (q,) = build_graph(str(VIT)).carried
    assert q.what == "gain" and q.nbytes == 64 * 2 and (q.exps.b, q.exps.s) == (0.0, 0.0)


def test_a_model_whose_encoder_output_joins_the_hidden_state_carries_nothing() -> None:
    twin, graph = _graph(carry=False), _graph()
    assert twin.carried == () and twin.carried_bytes(8, 1.0) == 0.0
    assert twin.block_input_bytes == graph.block_input_bytes
    cluster = load_cluster("h100-80g")
    cfg = config_from_plan(_plan())
    stripped = build_terms(dataclasses.replace(graph, carried=()), cluster, cfg)
    assert build_terms(twin, cluster, cfg).p2p_s == stripped.p2p_s  # same hidden state: same sends


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_a_pp2_plan_sends_and_holds_the_carried_bytes_beside_the_hidden_state(tp: int, sp: bool) -> None:
    graph, cluster = _graph(dtype="fp32"), load_cluster("h100-80g")
    stripped = dataclasses.replace(graph, carried=())
    cfg = config_from_plan(_plan(tp=tp, sp=sp))
    carried = 4 * SEQ_LEN * ENC * 4  # micro-batch 4, fp32, whole on every tp rank
    hidden = graph.block_input_bytes * 4 / (tp if sp else 1)
    link = axis_link(cluster, Layout.of(cfg), "pp")
    terms, before = build_terms(graph, cluster, cfg), build_terms(stripped, cluster, cfg)
    assert terms.carried_bytes == carried and before.carried_bytes == 0.0
    assert before.p2p_s == collective_time_s("p2p", hidden, link)
    assert terms.p2p_s == collective_time_s("p2p", hidden + carried, link)
    assert terms.pipeline_buffer_bytes - before.pipeline_buffer_bytes == pytest.approx(carried)  # fp32: no autocast copy
    chunks = [2, 2]
    now, then = (evaluate(t, chunks, 0.0, 1.0, cluster.peak_flops).ranks for t in (terms, before))
    m = cfg.num_microbatches
    # every micro-batch's receive buffer: the later stage's carried values, the first stage's their gradients
    for r in (0, 1):
        assert now[r].memory_bytes["other"] - then[r].memory_bytes["other"] == pytest.approx(m * carried)
        assert now[r].memory_bytes["activations"] == then[r].memory_bytes["activations"]


def test_with_pipeline_scatter_gather_the_carried_values_go_whole_beside_each_rail_share() -> None:
    graph, cluster = _graph(dtype="fp32"), load_cluster("a100-80g-megatron")
    assert cluster.pipeline_scatter_gather
    cfg = config_from_plan(_plan(tp=2))
    layout = Layout.of(cfg)
    hidden, carried = graph.block_input_bytes * 4, 4 * SEQ_LEN * ENC * 4
    want = collective_time_s("p2p", hidden / 2 + carried, axis_link(cluster, layout, "pp")) + \
        collective_time_s("all_gather", hidden, axis_link(cluster, layout, "tp"))
    assert build_terms(graph, cluster, cfg).p2p_s == want


def test_without_a_pipeline_the_carried_values_cost_nothing() -> None:
    graph, cluster = _graph(), load_cluster("h100-80g")
    cfg = config_from_plan(_plan(pp=1))
    assert build_terms(graph, cluster, cfg) == build_terms(dataclasses.replace(graph, carried=()), cluster, cfg)


def test_explain_shows_the_carried_bytes_where_p2p_appears() -> None:
    graph, cluster = _graph(dtype="fp32"), load_cluster("h100-80g")
    text = format_explanation(explain_plan(_plan(), graph, cluster))
    assert "carried beside the hidden state: 128.0 KiB per micro-batch (encoder)" in text
    assert "PP carried values/gradients" in text
    plain = format_explanation(explain_plan(_plan(), dataclasses.replace(graph, carried=()), cluster))
    assert "carried" not in plain


def test_the_later_stage_prediction_moves_toward_the_rehearsal() -> None:
    """The executor on fake tensors (``autopar rehearse``) holds each micro-batch's carried values on
    the later stage: priced, the prediction of its peak comes closer to the rehearsed one."""
    from autopar.cost.estimate import estimate_plan
    from autopar.rehearse.compare import rehearse

    plan = dataclasses.replace(_plan(), cluster=dataclasses.replace(_plan().cluster, profile="cpu-local-2",
                                                                   gpus_per_node=2))
    graph, cluster = _graph(dtype="fp32"), load_cluster("cpu-local-2")
    priced = estimate_plan(plan, graph, cluster)
    unpriced = estimate_plan(plan, dataclasses.replace(graph, carried=()), cluster)
    (rank,) = rehearse(plan, str(ENCODER), priced, "cpu-local-2", ranks=[1], workers=1).ranks
    rehearsed = rank.peak_bytes - rank.reserve_bytes
    now, before = (e.ranks[1].peak_bytes - e.reserve_bytes for e in (priced, unpriced))
    assert now - before == pytest.approx(plan.num_microbatches * 4 * SEQ_LEN * ENC * 4)
    assert abs(now - rehearsed) < abs(before - rehearsed)
