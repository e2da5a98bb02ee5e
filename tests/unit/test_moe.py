"""Mixtures of experts on meta: expert compute counted at the expected tokens per expert
(tokens x top_k / E under balanced routing), all experts' parameters in memory, the MoE facts in
the model spec, and no sequence parallelism offered for MoE blocks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autopar.graph.measure import build_graph
from autopar.modelfile import load_model_file
from autopar.spec import model_spec
from autopar.spec.moe import MoESpec

DATA = Path(__file__).resolve().parents[1] / "data" / "models"


def _variant(tmp_path: Path, name: str, source: str, **constants: object) -> Path:
    """A copy of ``source`` (a fixture model file) with module constants rewritten."""
    text = (DATA / source).read_text()
    for key, value in constants.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value!r}", text, count=1, flags=re.M)
        if n == 0:
            raise KeyError(f"{source} has no module constant {key}")
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


def _topk(tmp_path: Path, name: str, *, d=64, f=128, e=4, k=2, s=32, dense=False, routing="where") -> Path:
    text = (DATA / "topk_moe.py").read_text()
    text = text.replace("D, F_EXPERT, E, K, H, L, V = 64, 128, 4, 2, 4, 2, 256",
                        f"D, F_EXPERT, E, K, H, L, V = {d}, {f}, {e}, {k}, 4, 2, 256")
    text = text.replace("SEQ_LEN = 32", f"SEQ_LEN = {s}").replace("DENSE = False", f"DENSE = {dense}")
    text = text.replace('ROUTING = "where"', f"ROUTING = {routing!r}")
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


def _block_fwd_flops(graph) -> float:
    return sum(op.flops for op in graph.regions["block"].ops if op.phase == "fwd")


def _block_bwd_flops(graph) -> float:
    return sum(op.flops for op in graph.regions["block"].ops if op.phase == "bwd")


@pytest.mark.parametrize("routing", ["where", "sorted"])
def test_topk_moe_block_flops_are_attention_plus_top_k_experts_plus_router(tmp_path, routing) -> None:
    """Per-expert torch.where(idx == e) with an any() check, or tokens sorted by expert and sliced
    by bincount(...).tolist() counts: either way each expert gets tokens x top_k / E rows."""
    d, f, e, k, s = 64, 128, 4, 2, 32
    g = build_graph(str(_topk(tmp_path, f"moe_{routing}", d=d, f=f, e=e, k=k, s=s, routing=routing)), dtype="fp32")
    attention = 2 * d * 3 * d + 2 * d * d + 4 * s * d  # qkv, out projection, q.k^T and p.v per token
    experts = k * (2 * d * f + 2 * f * d)  # top_k experts of up + down per token
    router = 2 * d * e
    per_token = _block_fwd_flops(g) / s
    assert per_token == pytest.approx(attention + experts + router, rel=0.03)
    # all E experts would be E / k times the expert share: counted at top_k, not at E, not at 0
    assert per_token < attention + router + e / k * experts * 0.75
    assert _block_bwd_flops(g) == pytest.approx(2 * _block_fwd_flops(g), rel=0.05)


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_hf_mixtral_block_flops_per_token(tmp_path, experts) -> None:
    pytest.importorskip("transformers")
    path = _variant(tmp_path, f"mixtral_{experts}", "hf_mixtral_tiny.py", EXPERTS=experts)
    g = build_graph(str(path))
    mf = load_model_file(path)
    cfg = mf.module.CONFIG
    d, f, s = cfg.hidden_size, cfg.intermediate_size, mf.seq_len
    kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)
    attention = 2 * d * (2 * d + 2 * kv) + 4 * s * d  # q, o (d x d), k, v (d x kv), scores and p.v
    expert_mlp = 3 * 2 * d * f  # gate, up, down
    router = 2 * d * cfg.num_local_experts
    expected = attention + cfg.num_experts_per_tok * expert_mlp + router
    assert _block_fwd_flops(g) / s == pytest.approx(expected, rel=0.03)
    # every expert's parameters are in memory on every rank (no expert parallelism)
    spec = model_spec(mf)
    assert spec.moe is not None and spec.moe.num_experts == cfg.num_local_experts
    assert g.params["block"].count >= spec.moe.expert_params == cfg.num_local_experts * expert_mlp // 2


def test_hf_mixtral_grouped_mm_traces_in_fp32(tmp_path) -> None:
    """torch's meta kernel of ``_grouped_mm`` takes bf16 only, its CPU kernel fp32 too: an fp32 plan
    (a CPU profile's dtype) of a grouped-GEMM MoE traces forward and backward -- the backward's
    gradient GEMMs as well, seen first by the live-memory tracker (graph/live.py) -- with the FLOPs
    of bf16."""
    pytest.importorskip("transformers")
    path = _variant(tmp_path, "mixtral_fp32", "hf_mixtral_tiny.py", EXPERTS="grouped_mm")
    fp32, bf16 = build_graph(str(path), dtype="fp32"), build_graph(str(path), dtype="bf16")
    assert _block_bwd_flops(fp32) == pytest.approx(_block_bwd_flops(bf16))
    assert _block_fwd_flops(fp32) == pytest.approx(_block_fwd_flops(bf16))


def test_hf_mixtral_moe_spec_and_sequence_parallelism(tmp_path) -> None:
    pytest.importorskip("transformers")
    spec = model_spec(load_model_file(_variant(tmp_path, "mixtral_spec", "hf_mixtral_tiny.py", EXPERTS="grouped_mm")))
    moe = spec.moe
    assert isinstance(moe, MoESpec)
    assert (moe.experts_path, moe.experts_kind, moe.num_experts, moe.top_k, moe.top_k_source, moe.router_name) == (
        "mlp.experts", "stacked", 4, 2, "config", "mlp.gate")
    assert moe.params_per_expert == 3 * 64 * 128
    if spec.support["tp"] is None:  # its routed part runs on the sequence shard (spec/sp_check.py)
        assert spec.support["sp"] is None


def test_topk_moe_spec_reads_top_k_from_the_router_call(tmp_path) -> None:
    spec = model_spec(load_model_file(_topk(tmp_path, "moe_spec", e=8, k=3)))
    assert spec.moe is not None
    assert (spec.moe.experts_path, spec.moe.experts_kind, spec.moe.num_experts, spec.moe.top_k) == (
        "moe.experts", "ModuleList", 8, 3)
    assert spec.moe.top_k_source == "topk call" and spec.moe.router_name == "moe.router"
    assert spec.moe.expert_params == 8 * 2 * 64 * 128


def test_top1_argmax_routing_is_a_router(tmp_path) -> None:
    """Switch-style top-1 routing (scores.argmax(-1), no topk call, no top-k in a config or attribute):
    the spec finds the experts with top_k 1, and the block counts one expert per token, not none."""
    d, f, e, s = 64, 128, 4, 32
    path = _topk(tmp_path, "moe_argmax", d=d, f=f, e=e, k=1, s=s, routing="argmax")
    spec = model_spec(load_model_file(path))
    assert spec.moe is not None and (spec.moe.num_experts, spec.moe.top_k) == (e, 1)
    assert spec.moe.top_k_source == "topk call" and spec.moe.router_name == "moe.router"
    g = build_graph(str(path), dtype="fp32")
    attention = 2 * d * 3 * d + 2 * d * d + 4 * s * d
    expert, router = 2 * d * f + 2 * f * d, 2 * d * e
    assert _block_fwd_flops(g) / s == pytest.approx(attention + expert + router, rel=0.03)


def test_dense_model_has_no_moe(tmp_path) -> None:
    assert model_spec(load_model_file(_topk(tmp_path, "dense_spec", dense=True))).moe is None


def test_moe_spec_validates() -> None:
    with pytest.raises(ValueError, match="top_k"):
        MoESpec(experts_path="x", experts_kind="stacked", num_experts=4, top_k=5, top_k_source="config",
                params_per_expert=10, router_name=None)


def test_step_time_scales_with_the_experts_used(tmp_path, make_plan, a100) -> None:
    """Step time follows the experts a token uses: a top-2 MoE is at least as slow as a dense MLP
    of the same FLOPs per token (width 2F; its expert GEMMs are smaller and its routing adds memory
    traffic), slower than top-1 by at least the extra expert FLOPs at peak, and faster than running
    all E experts on every token (a dense MLP of width E x F)."""
    from autopar.cost.estimate import estimate_plan

    size = dict(d=1024, f=2048, e=8, s=1024)
    top2 = build_graph(str(_topk(tmp_path, "big_top2", k=2, **size)))
    top1 = build_graph(str(_topk(tmp_path, "big_top1", k=1, **size)))
    dense2 = build_graph(str(_topk(tmp_path, "big_dense2", k=2, dense=True, **size)))
    dense_all = build_graph(str(_topk(tmp_path, "big_dense8", k=8, dense=True, **size)))
    batch = 8
    plan = make_plan(2, global_batch_size=batch, micro_batch_size=1, seq_len=1024, dp=1)

    def step_s(g) -> float:
        return estimate_plan(plan, g, a100).step_time_s

    f2, f1 = top2.model_flops_per_sample(), top1.model_flops_per_sample()
    assert f2 == pytest.approx(dense2.model_flops_per_sample(), rel=0.02)
    assert f2 > 1.3 * f1
    assert step_s(top2) >= 0.95 * step_s(dense2)
    assert step_s(top2) - step_s(top1) >= (f2 - f1) * batch / a100.peak_flops
    assert step_s(top2) < step_s(dense_all)
    assert estimate_plan(plan, top2, a100).mfu < 0.75

    # activations kept for backward follow the routed tokens as well: top-2 keeps about twice the
    # expert activations of top-1, at least what the dense MLP of the same width keeps (plus the
    # routed copies of the tokens, the gathered rows each expert saves), far from all E
    def saved(g) -> float:
        return sum(q.nbytes for q in g.regions["block"].saved)

    attention_only = saved(top1) - (saved(top2) - saved(top1))  # the part that does not route
    assert saved(top2) > saved(top1) > attention_only > 0
    assert saved(dense2) * 0.95 <= saved(top2) <= saved(dense2) * 1.6
    assert saved(top2) < 0.6 * saved(dense_all)


def test_plan_search_says_why_sp_is_left_out_for_moe(tmp_path) -> None:
    """The plan's ``rejected`` line carries the model spec's SP refusal (not a silent omission)."""
    from collections import Counter

    from autopar.search.space import SearchSpace, enumerate_branches

    g = build_graph(str(_topk(tmp_path, "moe_rejected")), dtype="fp32")
    assert g.supports("tp") is None and "the tp plan shards the experts" in g.supports("sp")
    rejected: Counter = Counter()
    space = SearchSpace(num_gpus=4, gpus_per_node=4, global_batch=8, seq_len=32, micro_batches=(1,))
    branches = list(enumerate_branches(g, space, rejected))
    assert branches and not any(b.sequence_parallel for b in branches)
    assert [k for k in rejected if k.startswith("sp: ")] == [f"sp: {g.supports('sp')}"]


def test_sliding_window_is_read_only_where_the_layer_uses_one() -> None:
    """Qwen2-MoE's config carries sliding_window = 0 with use_sliding_window = False and per-layer
    layer_types; its attention has no window (CP was refused for "a sliding window (0 tokens)")."""
    from types import SimpleNamespace

    from torch import nn

    from autopar.spec.attention import _window

    bare, windowed = nn.Module(), nn.Module()
    windowed.sliding_window = 16
    assert _window(bare, SimpleNamespace(sliding_window=0, use_sliding_window=False)) is None
    assert _window(bare, SimpleNamespace(sliding_window=4096, layer_types=["full_attention"])) is None
    assert _window(bare, SimpleNamespace(sliding_window=16)) == 16  # Mistral: the config's window applies
    assert _window(windowed, SimpleNamespace(sliding_window=None, layer_types=["sliding_attention"])) == 16
    assert _window(bare, SimpleNamespace(sliding_window=0)) is None


def test_a_window_on_any_layer_counts_whichever_layer_is_probed() -> None:
    """Llama 4 attends within chunks on three layers of four, Qwen2 with a window slides only from
    max_window_layers on: a full-attention block 0 does not make the model full-causal."""
    from types import SimpleNamespace

    from torch import nn

    from autopar.spec.attention import _window

    full = nn.Module()
    full.sliding_window = None  # the probed block's own attribute: a full-attention layer
    llama4 = SimpleNamespace(attention_chunk_size=8192, layer_types=["full_attention", "chunked_attention"])
    assert _window(nn.Module(), llama4) == 8192
    qwen2 = SimpleNamespace(sliding_window=4096, use_sliding_window=True,
                            layer_types=["full_attention", "sliding_attention"])
    assert _window(full, qwen2) == 4096
    off = SimpleNamespace(sliding_window=4096, use_sliding_window=False, layer_types=["full_attention"] * 2)
    assert _window(full, off) is None
    both = SimpleNamespace(sliding_window=128, attention_chunk_size=64,
                           layer_types=["sliding_attention", "chunked_attention", "full_attention"])
    assert _window(nn.Module(), both) == 64  # the narrowest


def test_a_window_no_shorter_than_the_models_sequence_is_no_window() -> None:
    """Llama 4 Scout attends within chunks of 8192 tokens; planned at its SEQ_LEN of 4096 (a plan never
    trains longer) every layer attends to the whole prefix, and context parallelism is exact."""
    from types import SimpleNamespace

    from torch import nn

    from autopar.spec.attention import _window

    scout = SimpleNamespace(attention_chunk_size=8192, layer_types=["chunked_attention", "full_attention"])
    assert _window(nn.Module(), scout, seq_len=4096) is None
    assert _window(nn.Module(), scout, seq_len=8192) is None
    assert _window(nn.Module(), scout, seq_len=16384) == 8192
    assert _window(nn.Module(), scout) == 8192  # no SEQ_LEN: any window counts
