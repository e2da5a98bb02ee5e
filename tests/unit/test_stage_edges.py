"""What a pipeline stage holds at its edges, priced as torch pipelining holds it.

* A chunk's output stays in its stage's ``fwd_cache`` until the micro-batch's backward, beyond the
  saved activations of its blocks unless its last block saves it itself (a ResNet bottleneck's last
  ReLU does; a transformer's residual add does not).
* A receiving chunk's first block saves the receive buffer itself where it saves its input (a GPT
  block's first LayerNorm does; Llama's RMSNorm saves an fp32 copy): priced with the buffers, not
  again with the activations.
* A rank holds its rows of the step's batch (global batch / dp samples of the model's inputs as the
  model file makes them) on its device through the step.
* A layer chain's unit peaks in its backward beside the saved activations of the units before it on
  the stage only: the later ones' are released by then (cost.chain.stage_phase_bytes).

Checked against rehearsals of the executor (tests/unit/test_chain_pipeline_rehearsal.py; figures in
docs/results.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autopar.cluster import load_cluster
from autopar.cost.terms import Config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _config(**kw) -> Config:  # noqa: ANN003
    base = dict(dp=1, tp=1, pp=2, cp=1, cp_kind="ring", sequence_parallel=False, zero=1, recompute="none",
                schedule="interleaved-1f1b", virtual_stages=2, micro_batch=2, global_batch=16, seq_len=64,
                dtype_bytes=2, optimizer="adam")
    return Config(**{**base, **kw})


@pytest.fixture(scope="module")
def gpt():  # noqa: ANN201
    from autopar.models.gpt import GPTConfig
    from autopar.reference import gpt_graph

    return gpt_graph(GPTConfig(num_layers=4, hidden_size=128, num_heads=4, seq_len=64, vocab_size=256))


def test_the_trace_says_which_tensors_a_block_saves_of_its_own_edges(gpt, tmp_path: Path) -> None:
    from autopar.graph.measure import build_graph
    from autopar.models.llama import LlamaConfig, model_file

    assert gpt.block_saves_input and not gpt.block_saves_output  # LayerNorm first, a residual add last
    llama = tmp_path / "llama.py"
    llama.write_text(model_file(LlamaConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                                            ffn_hidden_size=256, seq_len=64, vocab_size=256)), encoding="utf-8")
    graph = build_graph(str(llama))
    assert not graph.block_saves_input and not graph.block_saves_output  # RMSNorm saves an fp32 copy
    resnet = build_graph(str(EXAMPLES / "zoo" / "resnet.py"))
    # each bottleneck's last ReLU saves its output; the next one's first conv saves that same tensor,
    # which the trace counts once, with the unit that saved it first
    assert all(u.saves_output for u in resnet.chain)
    assert not any(u.saves_input for u in resnet.chain[1:])
    assert resnet.batch_input_bytes == 3 * 16 * 16 * 4  # one fp32 image of the tiny size


def test_chunk_edges_hand_on_and_credit_the_received_input(gpt) -> None:
    from autopar.cost.stage import build_terms

    cluster = load_cluster("h100-80g")
    terms = build_terms(gpt, cluster, _config())
    hidden = gpt.block_input_bytes * 2  # one micro-batch of two samples, bf16
    assert terms.handoff_bytes == terms.received_saved_bytes == terms.hidden_bytes == hidden
    # rank 0: its chunks hand on and (but the model's first) receive; rank 1's last is the model's last
    assert terms.chunk_edge_bytes(0) == [terms.pre.act_bytes + hidden, 0.0]
    assert terms.chunk_edge_bytes(1) == [0.0, -hidden]
    # full recompute keeps the block's input, no tensor of its own
    full = build_terms(gpt, cluster, _config(recompute="full"))
    assert full.chunk_edge_bytes(1) == [0.0, -hidden]
    # no pipeline: the embedding's activations only
    flat = build_terms(gpt, cluster, _config(pp=1, virtual_stages=1, schedule="1f1b"))
    assert flat.chunk_edge_bytes(0) == [flat.pre.act_bytes]
    # software that frees a chunk's output once sent and allocates receive buffers as it goes
    megatron = dataclasses.replace(cluster, pipeline_buffers_per_microbatch=False)
    assert build_terms(gpt, megatron, _config()).chunk_edge_bytes(1) == [0.0, 0.0]


def test_a_rank_holds_its_rows_of_the_batch(gpt) -> None:
    from autopar.cost.stage import build_terms

    cfg = _config(dp=2, global_batch=32)
    terms = build_terms(gpt, load_cluster("h100-80g"), cfg)
    assert gpt.batch_input_bytes > 0
    assert terms.batch_bytes == pytest.approx(gpt.batch_input_bytes * 16)
    with_batch = terms.rank_other_bytes(0, 1)
    assert with_batch - dataclasses.replace(terms, batch_bytes=0.0).rank_other_bytes(0, 1) == pytest.approx(
        terms.batch_bytes)


def test_a_chain_units_backward_peaks_beside_the_units_before_it() -> None:
    from autopar.cost.chain import build_chain_terms, stage_phase_bytes
    from autopar.graph.measure import build_graph

    graph = build_graph(str(EXAMPLES / "zoo" / "resnet.py"))
    terms = build_chain_terms(graph, load_cluster("h100-80g"), _config(virtual_stages=1, schedule="1f1b",
                                                                        seq_len=1))
    acts = [u.act_bytes for u in terms.units]
    for start, end in ((0, 3), (2, len(acts)), (1, 2)):
        brute = max(terms.unit_phase_bytes[u] - sum(acts[u + 1:end]) for u in range(start, end))
        assert stage_phase_bytes(terms, start, end) == pytest.approx(brute)
    # the chain search's prefix sums give the same
    from autopar.search.chain_search import StagePricer

    oracle = StagePricer(terms)
    assert oracle.load(0, 3, 0).phase_bytes == pytest.approx(stage_phase_bytes(terms, 0, 3))
