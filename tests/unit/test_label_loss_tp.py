"""Hugging Face causal LMs trained through ``labels`` keep tensor parallelism in the planner and the
profiler: the model's own label loss views the logits by ``config.vocab_size``, which fails on one tp
rank's half-vocabulary meta logits. A tp rank's meta copy divides the model's vocabulary attributes
too (spec/tp_shard.localise_vocab_constants), so the loss runs on the rank's slice and is priced
vocab-parallel, as the executor runs it on DTensor logits under ``loss_parallel()``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from autopar.modelfile import load_model_file  # noqa: E402
from autopar.spec import model_spec  # noqa: E402

GLM4 = Path(__file__).resolve().parents[2] / "examples" / "zoo" / "hf_glm4.py"


def test_a_label_trained_model_keeps_tp_and_its_loss_is_priced_vocab_parallel() -> None:
    from autopar.graph.measure import build_graph

    g = build_graph(GLM4)
    assert g.support["tp"] is None and g.support["sp"] is None, (g.support["tp"], g.support["sp"])
    # The label loss runs inside the model's forward, after the head: the post region. Its
    # log-softmax and the logits' float copy touch the rank's vocabulary slice (bytes ~ 1/tp).
    vocab_ops = [op for op in g.regions["post"].ops if op.name in ("_log_softmax", "_log_softmax_backward_data")]
    assert len(vocab_ops) == 2 and all(op.bytes_exps.t == pytest.approx(1.0) for op in vocab_ops)
    assert g.shards_with_tp("post")  # so loss_parallel's per-token all-reduces are priced too


def test_a_carried_plan_with_styles_autopar_does_not_run_gives_way_to_the_data_flow() -> None:
    """GLM-4's HF plan marks the fused gate_up_proj colwise_gather_output (not run); the data flow
    shards q/k/v/o as the HF plan does and the MLP too, so its plan is used and SP is offered."""
    spec = model_spec(load_model_file(GLM4))
    assert spec.tp.source == "inferred" and "covers 4 of these layers" in spec.tp.detail
    assert spec.tp.styles["mlp.gate_up_proj"] == "colwise" and spec.tp.styles["mlp.down_proj"] == "rowwise"
    assert spec.tp.styles["self_attn.o_proj"] == "rowwise" and spec.tp.fused["mlp.gate_up_proj"] == 2
    assert any("colwise_gather_output" in n for n in spec.tp.dropped)
    assert spec.support_reason("sp") is None


def test_profile_at_tp_2_runs_a_models_own_label_loss() -> None:
    from autopar.profiler.layers import LayerProfileConfig, profile_layers

    torch.set_num_threads(1)
    cfg = LayerProfileConfig(micro_batches=(1,), tps=(1, 2), cps=(1,), dtype="fp32", warmup=0, repeats=1)
    table = profile_layers(load_model_file(GLM4), torch.device("cpu"), cfg)
    assert {p.tp for p in table.regions["post"]} == {1, 2}
