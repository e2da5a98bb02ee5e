"""An MoE layer's activations as Megatron-Core keeps them (autopar.cost.megatron_moe_memory): the
per-token bytes against hand counts of what each Megatron / TE module saves, the recompute modules
that drop them, the widths read off the model files, and the published Megatron-MoE-ModelZoo runs
(calibration/megatron_moe_h100.yaml), which ran on 80 GB H100s, priced within that device."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cost.fused_moe import MoeWidths
from autopar.cost.megatron_memory import LayerWidths, megatron_activations
from autopar.cost.megatron_moe_memory import megatron_block_activations, moe_activations, moe_bytes_per_token
from autopar.cost.terms import Config

H, F, K, E, SEQ = 6144, 16384, 2, 8, 4096  # Mixtral 8x22B's widths, the model zoo's sequence


def _mixtral(**kw) -> MoeWidths:  # noqa: ANN003
    dense = LayerWidths(hidden=H, attn_in=H + 2 * 1024, attn_out=H, mlp_in=0, mlp_mid=0, heads=48, dropouts=0,
                        vocab=32000)
    return dataclasses.replace(MoeWidths(dense=dense, shared_sharded=False, experts=E, top_k=K, expert_in=2 * F,
                                         expert_mid=F, experts_sharded=False), **kw)


def _cfg(**kw) -> Config:  # noqa: ANN003
    base = Config(dp=8, tp=2, pp=8, cp=1, cp_kind="ring", sequence_parallel=True, zero=1, recompute="none",
                  schedule="1f1b", virtual_stages=1, micro_batch=1, global_batch=256, seq_len=SEQ, dtype_bytes=2,
                  optimizer="adam", ep=8)
    return dataclasses.replace(base, **kw)


def test_mixtral_keeps_the_dense_layer_plus_k_rows_of_h_2f_and_f_per_token() -> None:
    """tp 2 + SP: per token, the norms' inputs and outputs (4 h) and q, k, v, the attention output
    (h + 2 x 1024 + h) as the dense layer; the router's E-wide map, two fp32 score rows and the permute's
    int64 row map (17 E); k = 2 permuted rows of h, fc1's 2 f output and the SwiGLU's f output with
    an fp32 probability each; all on the sequence shard (/ 2)."""
    act = moe_activations(_mixtral(), _cfg(), 2, "none", qk_norm=False)
    dense = 2 * 4 * H / 2 + 2 * (H + 2048 + H) / 2 + 4 * 48 / 2
    moe = 17 * E / 2 + K * (2 * (H + 2 * F + F) + 4) / 2
    assert act.block == pytest.approx(SEQ * (dense + moe))
    assert act.block / 2**30 == pytest.approx(0.571, abs=0.001)  # the HF file's eager ops kept 0.84 GiB


def test_the_moe_half_is_what_the_dense_formula_misses() -> None:
    w, cfg = _mixtral(), _cfg()
    dense = megatron_activations(w.dense, cfg, 2, "none")
    extra = moe_bytes_per_token(w, cfg, 2, qk_norm=False)
    assert moe_activations(w, cfg, 2, "none", qk_norm=False).block == pytest.approx(dense.block + SEQ * extra)
    assert extra > 2.5 * (dense.block / SEQ)  # the experts' rows dominate an MoE layer


def test_recompute_modules_moe_act_and_layernorm_drop_the_activation_output_and_the_norm_output() -> None:
    w, cfg = _mixtral(), _cfg()
    none = moe_bytes_per_token(w, cfg, 2, qk_norm=False)
    act = moe_bytes_per_token(w, cfg, 2, qk_norm=False, moe_act=True)
    both = moe_bytes_per_token(w, cfg, 2, qk_norm=False, moe_act=True, layernorm=True)
    assert none - act == pytest.approx(K * 2 * F / 2)  # fc2's input, k f per token, on the shard
    assert act - both == pytest.approx(2 * H / 2)  # the pre-MLP norm's output


def test_full_recompute_keeps_the_input_and_re_runs_everything() -> None:
    w = _mixtral()
    none = moe_activations(w, _cfg(), 2, "none", qk_norm=False)
    full = moe_activations(w, _cfg(recompute="full"), 2, "full", qk_norm=False)
    selective = moe_activations(w, _cfg(recompute="selective"), 2, "selective", qk_norm=False)
    assert full.block == pytest.approx(SEQ * 2 * H / 2)
    assert full.block_working == pytest.approx(none.block)
    assert selective.block == pytest.approx(none.block - SEQ * 4 * 48 / 2)  # the attention's fp32 statistics


def test_the_busiest_rank_keeps_imbalance_times_the_rows_and_expert_tp_gathers_them() -> None:
    w = _mixtral()
    base = moe_bytes_per_token(w, _cfg(), 2, qk_norm=False)
    skewed = moe_bytes_per_token(w, _cfg(moe_imbalance=1.5), 2, qk_norm=False)
    rows = K * (2 * (H + 3 * F) + 4) / 2
    assert skewed - base == pytest.approx(0.5 * rows)
    sharded = moe_bytes_per_token(dataclasses.replace(w, experts_sharded=True), _cfg(), 2, qk_norm=False)
    assert sharded - 17 * E / 2 == pytest.approx(K * (2 * H + 4 + 2 * 3 * F / 2))  # rows whole, widths / tp


def test_qk_norms_keep_q_and_k_and_a_replicated_shared_expert_sits_on_the_shard() -> None:
    w, cfg = _mixtral(), _cfg()
    assert (moe_bytes_per_token(w, cfg, 2, qk_norm=True) - moe_bytes_per_token(w, cfg, 2, qk_norm=False)
            == pytest.approx(2 * (H + 1024) / 2))
    shared = dataclasses.replace(w, dense=dataclasses.replace(w.dense, mlp_in=2 * 4096, mlp_mid=4096))
    sharded = moe_activations(dataclasses.replace(shared, shared_sharded=True), cfg, 2, "none", qk_norm=False)
    whole = moe_activations(shared, cfg, 2, "none", qk_norm=False)
    plain = moe_activations(w, cfg, 2, "none", qk_norm=False)
    assert sharded.block - plain.block == pytest.approx(SEQ * 2 * 3 * 4096 / 2)  # / tp, in the dense formula
    assert whole.block - plain.block == pytest.approx(SEQ * 2 * 3 * 4096 / 2)  # / sp, on the shard (sp = tp)
    nosp = _cfg(sequence_parallel=False)
    assert (moe_activations(shared, nosp, 2, "none", qk_norm=False).block
            - moe_activations(w, nosp, 2, "none", qk_norm=False).block) == pytest.approx(SEQ * 2 * 3 * 4096)


@pytest.mark.parametrize("key", ["qwen3-235b-a22b", "mixtral-8x22b"])
def test_the_model_files_widths_price_the_block_on_megatron_profiles_only(key: str) -> None:
    from autopar.cluster import load_cluster
    from autopar.cost.stage import build_terms
    from autopar.graph.cache import cached_graph
    from autopar.reference_moe import MODELS, model_path

    tiny = dataclasses.replace(MODELS[key], size="tiny")
    graph = cached_graph(str(model_path(tiny)), seq_len=None, dtype="bf16")[0]
    cfg = _cfg(dp=2, pp=1, ep=4, global_batch=4, seq_len=32)
    act = megatron_block_activations(graph, cfg)
    assert act is not None and act.post > 0  # the head's width read too
    terms = build_terms(graph, load_cluster("h100-80g-megatron"), cfg)
    assert terms.block.act_bytes == pytest.approx(act.block)
    eager = build_terms(graph, load_cluster("h100-80g"), cfg)  # autopar's executor keeps the model file's
    assert eager.block.act_bytes != pytest.approx(act.block)


def _ran():  # noqa: ANN202
    from autopar.reference_moe import moe_rows, row_plan

    return [r for r in moe_rows() if row_plan(r).plan is not None]


# The model zoo's runs ran on 80 GB H100s (its tables leave the memory column blank): each must fit.
# With the HF file's eager saved tensors they were priced over it (Qwen3 a2a ep8 pp32 86.2 GiB,
# Mixtral 81.0, Qwen3 DeepEP ep32 pp8 100.6).
@pytest.mark.parametrize("row", _ran(), ids=lambda r: r.name)
def test_published_megatron_moe_runs_fit_the_device_they_ran_on(row) -> None:  # noqa: ANN001
    from autopar.reference_moe import predict

    est = predict(row).estimate
    assert est.fits, (row.name, est.peak_memory_bytes / 2**30)
