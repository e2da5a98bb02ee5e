"""The last pipeline stage's output under torch pipelining: the stage keeps what the model
returned (the logits) from a micro-batch's forward through its backward (``fwd_cache``), where the
training loop without a pipeline drops it at the loss, and Megatron's schedules free it there too."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster import load_cluster
from autopar.cost.stage import build_terms
from autopar.models.gpt import GPTConfig
from autopar.reference import gpt_graph

VOCAB, SEQ, HIDDEN = 4096, 256, 128


@pytest.fixture(scope="module")
def graph():
    return gpt_graph(GPTConfig(num_layers=4, hidden_size=HIDDEN, num_heads=4, seq_len=SEQ, vocab_size=VOCAB), "bf16")


def test_the_model_output_is_measured_with_its_exponents(graph) -> None:
    out = graph.output
    assert out is not None and out.nbytes == pytest.approx(SEQ * VOCAB * 2, rel=1e-3)  # bf16 logits, one sample
    assert (out.exps.b, out.exps.s) == (1.0, 1.0)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_last_stage_holds_one_micro_batch_of_logits(graph, make_config, tp: int) -> None:
    h100 = load_cluster("h100-80g")
    cfg = make_config(pp=2, tp=tp, micro_batch=4, seq_len=SEQ, global_batch=32)
    terms = build_terms(graph, h100, cfg)
    sharded = graph.shards_with_tp("post")  # a vocabulary-parallel head returns its vocabulary shard
    assert terms.stage_output_bytes == pytest.approx(4 * SEQ * VOCAB * 2 / (tp if sharded else 1), rel=1e-3)
    last, first = terms.rank_other_bytes(1, 1), terms.rank_other_bytes(0, 1)
    without = dataclasses.replace(terms, stage_output_bytes=0.0)
    assert last - without.rank_other_bytes(1, 1) == pytest.approx(terms.stage_output_bytes)
    assert first == without.rank_other_bytes(0, 1)  # only the last stage holds it


def test_no_pipeline_or_megatron_schedules_hold_none(graph, make_config) -> None:
    assert build_terms(graph, load_cluster("h100-80g"), make_config(pp=1, seq_len=SEQ)).stage_output_bytes == 0.0
    megatron = load_cluster("h100-80g-megatron")
    assert build_terms(graph, megatron, make_config(pp=2, seq_len=SEQ, global_batch=32)).stage_output_bytes == 0.0
