"""Megatron-Core MoE runs on DGX H100 (calibration/megatron_moe_h100.yaml, from NVIDIA's
Megatron-MoE-ModelZoo) as autopar.reference_moe loads, maps and prices them.

The transcription is checked against the source's own arithmetic: every row's layout multiplies out
to its GPU count, gradient accumulation and expert data parallelism; each Qwen3-235B-A22B row's
TFLOP/s per GPU follows from its step time with Megatron-LM's FLOP count (so a typo in either
fails); the model shapes are the model files' and the published parameter totals. The row -> plan
mapping is checked on the full-size rows without measuring them, and priced on the tiny model only
(the full-size table is benchmarks/calibration.py's). The source is predicted only: no fit sees it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest

from autopar.reference import load_calibration
from autopar.reference_moe import (
    GROUP,
    MODELS,
    MODELS_DIR,
    PROFILE,
    megatron_chunk_layers,
    megatron_flops_per_step,
    moe_rows,
    row_plan,
)

ROWS = moe_rows()
BY_NAME = {r.name: r for r in ROWS}


def test_the_yaml_names_its_source_and_rows() -> None:
    data = load_calibration("megatron_moe_h100.yaml")
    assert "yanring/Megatron-MoE-ModelZoo" in data["source"] and "e8650517d60d71ab73fc6b3b0388cac4ba435181" in data["source"]
    assert "best_practice/qwen3/readme.md" in data["source"] and "run_mixtral_8x22B.sh" in data["source"]
    assert [r.name for r in ROWS] == [
        "qwen3-235b-deepep-ep32-pp8", "qwen3-235b-deepep-ep32-pp8-1f1b-overlap", "qwen3-235b-deepep-ep8-fsdp",
        "qwen3-235b-a2a-ep8-pp32", "qwen3-235b-deepep-tp4-ep8-pp8", "qwen3-next-80b-deepep",
        "mixtral-8x22b-a2a-dropless", "mixtral-8x22b-a2a-balanced"]
    assert {r.dispatcher for r in ROWS} == {"a2a", "deepep"}
    assert [r.name for r in ROWS if r.dispatcher == "a2a"] == [
        "qwen3-235b-a2a-ep8-pp32", "mixtral-8x22b-a2a-dropless", "mixtral-8x22b-a2a-balanced"]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_each_layout_multiplies_out(row) -> None:  # noqa: ANN001
    assert row.tp * row.cp * row.pp * row.dp == row.gpus
    assert row.ga * row.mbs * row.dp == row.gbs  # GA = GBS / (MBS x DP)
    assert row.edp * row.ep * row.etp == row.tp * row.dp * row.cp  # Megatron's expert data parallel size
    assert row.seq == 4096


QWEN3_WITH_STEP = [r for r in ROWS if r.model_key == "qwen3-235b-a22b"]


@pytest.mark.parametrize("row", QWEN3_WITH_STEP, ids=lambda r: r.name)
def test_the_tflops_follow_from_the_step_time_with_megatrons_flop_count(row) -> None:  # noqa: ANN001
    assert not row.derived
    tflops = megatron_flops_per_step(row.model, row.gbs, row.seq) / (row.step_time_s * row.gpus) / 1e12
    # the step time is printed to 0.1 s (0.2-0.6 % at these times), the TFLOP/s as an integer
    assert tflops == pytest.approx(row.tflops_per_gpu, rel=0.006)


def test_the_flop_count_is_megatrons_causal_one_and_a_typo_is_caught() -> None:
    row = BY_NAME["qwen3-235b-a2a-ep8-pp32"]
    m = row.model
    # without halving causal attention (Megatron-LM before its causal fix) the rows miss by 12 %
    full = megatron_flops_per_step(m, row.gbs, row.seq) + row.gbs * row.seq * 12 * m.layers * m.hidden * m.hidden \
        * (row.seq / m.hidden / 2) * (m.kv_channels * m.heads / m.hidden)
    assert full / (row.step_time_s * row.gpus) / 1e12 > 1.1 * row.tflops_per_gpu
    for typo in (21.2, 42.2, 24.8):
        tflops = megatron_flops_per_step(m, row.gbs, row.seq) / (typo * row.gpus) / 1e12
        assert abs(tflops / row.tflops_per_gpu - 1) > 0.02, typo


def test_mixtral_step_times_are_derived_from_its_tflops() -> None:
    for name, tflops in (("mixtral-8x22b-a2a-dropless", 445), ("mixtral-8x22b-a2a-balanced", 465)):
        row = BY_NAME[name]
        assert row.derived and row.tflops_per_gpu == tflops
        assert row.step_time_s * row.gpus * tflops * 1e12 == pytest.approx(
            megatron_flops_per_step(row.model, row.gbs, row.seq))
    assert BY_NAME["mixtral-8x22b-a2a-dropless"].step_time_s == pytest.approx(4.458, abs=0.001)


def _sizes(stem: str) -> dict:
    spec = importlib.util.spec_from_file_location(f"_moe_{stem}", MODELS_DIR / f"{stem}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # builds the tiny config only
    return mod.SIZES


def _params(m, ffn_dense: int = 0) -> int:  # noqa: ANN001
    """Parameters of an all-MoE decoder (SwiGLU experts, GQA, untied head, RMSNorms; Qwen3's q/k norms)."""
    h, d = m.hidden, m.kv_channels
    attn = h * m.heads * d * 2 + h * m.query_groups * d * 2
    experts = m.experts * 3 * h * m.moe_ffn + h * m.experts
    norms = 2 * h + (2 * d if m.key.startswith("qwen3") else 0)
    return m.layers * (attn + experts + norms) + 2 * m.vocab * h + h


def test_the_model_files_are_the_published_shapes() -> None:
    q = _sizes("hf_qwen3_moe")[MODELS["qwen3-235b-a22b"].size]
    m = MODELS["qwen3-235b-a22b"]
    assert (q["num_hidden_layers"], q["hidden_size"], q["num_attention_heads"], q["num_key_value_heads"], q["head_dim"],
            q["num_experts"], q["moe_intermediate_size"], q["num_experts_per_tok"], q["vocab_size"]) == (
        m.layers, m.hidden, m.heads, m.query_groups, m.kv_channels, m.experts, m.moe_ffn, m.topk, m.vocab)
    assert _params(m) == 235_093_634_560  # Qwen3-235B-A22B: 235 B
    x = _sizes("hf_mixtral")[MODELS["mixtral-8x22b"].size]
    m = MODELS["mixtral-8x22b"]
    assert (x["num_hidden_layers"], x["hidden_size"], x["num_attention_heads"], x["num_key_value_heads"],
            x["num_local_experts"], x["intermediate_size"], x["num_experts_per_tok"], x["vocab_size"]) == (
        m.layers, m.hidden, m.heads, m.query_groups, m.experts, m.moe_ffn, m.topk, m.vocab)
    assert x["hidden_size"] // x["num_attention_heads"] == m.kv_channels
    assert _params(m) == 140_620_634_112  # Mixtral 8x22B: 141 B


def test_megatron_splits_qwen3_with_the_embedding_and_loss_as_layers() -> None:
    counts = megatron_chunk_layers(94, 8, 4, True)  # 96 units over 32 chunks
    assert counts[0] == counts[-1] == 2 and set(counts[1:-1]) == {3} and sum(counts) == 94
    counts = megatron_chunk_layers(94, 32, 3, True)  # one unit each: the first and last chunk hold no layer
    assert counts[0] == counts[-1] == 0 and sum(counts) == 94
    assert megatron_chunk_layers(56, 8, 7, False) == [1] * 56


def test_the_a2a_rows_map_to_the_closest_plans_with_every_difference_flagged() -> None:
    q = row_plan(BY_NAME["qwen3-235b-a2a-ep8-pp32"])
    par = q.plan.parallel
    # sequence parallelism on, as the run: ep 8 drawn from dp x tp = 8 (autopar.layout's folds_tp)
    assert (par.dp, par.tp, par.pp, par.ep, par.zero, par.pp_virtual_stages, par.sequence_parallel, par.recompute) == (
        4, 2, 32, 8, 1, 1, True, "none")
    assert par.layout.group("ep", 0) == tuple(range(8))  # one node's 8 GPUs, as Megatron's
    per_rank = [b - a for a, b in q.plan.stage_ranges()]
    assert per_rank[0] == per_rank[-1] == 2 and set(per_rank[1:-1]) == {3}
    assert q.plan.cluster.profile == PROFILE and q.plan.training.global_batch_size == 2048
    text = " ".join(q.flags)
    assert "vpp 3 -> 1" in text and "norm, act" in text and not any(f.startswith("ep ") for f in q.flags)
    x = row_plan(BY_NAME["mixtral-8x22b-a2a-balanced"])
    par = x.plan.parallel
    assert (par.dp, par.tp, par.pp, par.ep, par.pp_virtual_stages, par.pp_schedule, par.stages) == (
        8, 2, 8, 8, 7, "interleaved-1f1b", None)
    assert x.plan.parallel.sequence_parallel and not any(f.startswith("ep ") for f in x.flags)


def test_rows_autopar_cannot_price_are_skipped_with_a_reason() -> None:
    assert "1F1B" in row_plan(BY_NAME["qwen3-235b-deepep-ep32-pp8-1f1b-overlap"]).skip
    assert "no model file" in row_plan(BY_NAME["qwen3-next-80b-deepep"]).skip
    fsdp = row_plan(BY_NAME["qwen3-235b-deepep-ep8-fsdp"])
    assert fsdp.plan.parallel.zero == 3 and fsdp.plan.parallel.recompute == "full" and "ZeRO-3" in fsdp.flags[0]


def test_a_shrunk_row_prices_on_the_tiny_model() -> None:
    from autopar.cluster import load_cluster
    from autopar.cost.estimate import estimate_plan
    from autopar.graph.cache import cached_graph
    from autopar.reference_moe import model_path

    tiny = dataclasses.replace(MODELS["qwen3-235b-a22b"], size="tiny", layers=4, experts=8,
                               account_for_embedding_and_loss=True)
    row = dataclasses.replace(BY_NAME["qwen3-235b-a2a-ep8-pp32"], gpus=8, tp=2, pp=2, vpp=1, dp=2, ep=4, edp=1,
                              gbs=4, ga=2, seq=32)
    mapped = row_plan(row, tiny)  # ep 4 from dp x tp = 4 under sequence parallelism
    assert mapped.plan.parallel.ep == 4 and [b - a for a, b in mapped.plan.stage_ranges()] == [2, 2]
    graph = cached_graph(str(model_path(tiny)), seq_len=None, dtype="bf16")[0]
    est = estimate_plan(mapped.plan, graph, load_cluster(PROFILE))
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0 and est.time_breakdown_s["ep_comm"] > 0


def test_the_source_is_held_out_never_fitted() -> None:
    from autopar import reference_fit

    assert GROUP not in reference_fit.SOURCES
