"""An MoE layer's element-wise work priced as Megatron-Core's fused kernels move it (autopar.cost.fused_moe,
autopar.cost.fused_elementwise.moe_block_traffic) and the dispatcher's chunk sorts under ep
(autopar.cost.expert.expert_sort_s): the widths are read off the block's own GEMMs, the bytes follow
the kernels' table, the eager ops are not priced on a fused profile and still are on autopar's own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autopar.cluster import load_cluster
from autopar.cost.compute import graph_region_time, op_time_s
from autopar.cost.expert import expert_sort_s
from autopar.cost.fused_elementwise import BWD_KERNELS, FWD_KERNELS, block_traffic, qk_normed, traffic_of
from autopar.cost.fused_moe import MOE_KERNELS, SCORE_BYTES, moe_traffic, moe_widths, sort_bytes_per_token
from autopar.graph import build_graph
from autopar.graph.scaling import Shape

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = load_cluster("h100-80g-megatron")
EAGER = load_cluster("h100-80g")


@pytest.fixture(scope="module")
def qwen3():  # noqa: ANN201 - tiny HF Qwen3-MoE: 8 experts of 32, top-2, q/k norms, GQA (head dim 32)
    return build_graph(str(ROOT / "autopar/models/hf_qwen3_moe.py"), dtype="bf16")


@pytest.fixture(scope="module")
def qwen2():  # noqa: ANN201 - tiny HF Qwen2-MoE: 4 experts of 32, top-2, a gated shared expert of 64
    return build_graph(str(ROOT / "examples/zoo/hf_qwen2_moe.py"), dtype="bf16")


def test_widths_are_read_off_the_blocks_gemms(qwen3, qwen2) -> None:  # noqa: ANN001
    w = moe_widths(qwen3)
    # hidden 64; q 4 x 32, k and v 2 x 32; each expert's SwiGLU 2 x 32 in, 32 out; no shared expert
    assert (w.dense.hidden, w.dense.attn_in, w.dense.attn_out) == (64, 128 + 2 * 64, 128)
    assert (w.experts, w.top_k, w.expert_in, w.expert_mid) == (8, 2, 64, 32)
    assert (w.dense.mlp_in, w.dense.mlp_mid, w.experts_sharded) == (0, 0, False)
    s = moe_widths(qwen2)  # its shared expert's three projections are all 64 x 64: the last is the down one
    assert (s.expert_in, s.expert_mid, s.dense.mlp_in, s.dense.mlp_mid) == (64, 32, 128, 64)


def test_qk_norm_is_found_by_behaviour(qwen3, qwen2) -> None:  # noqa: ANN001
    assert qk_normed(qwen3) and not qk_normed(qwen2)


def test_traffic_follows_the_kernels_table(qwen3) -> None:  # noqa: ANN001
    w, d = moe_widths(qwen3), 2
    h, k, e, f1, f2 = 64, 2, 8, 64, 32
    m = moe_traffic(w, d)
    probs = SCORE_BYTES * k
    assert m.fwd_stream_bytes == ((d + 2 * SCORE_BYTES + 1) * e + 2 * k * d * h + 2 * probs + (k + 1) * d * h
                                  + k * d * (f1 + f2) + probs)
    assert m.bwd_stream_bytes == (2 * (k + 1) * d * h + 2 * probs + (2 * SCORE_BYTES + d) * e
                                  + k * d * (2 * f1 + f2) + 2 * probs)
    assert m.fwd_wide_bytes == m.bwd_wide_bytes == 0.0  # the experts work on the routing rank's rows
    t = block_traffic(qwen3)
    dense = traffic_of(w.dense, d, True, True)
    assert t.fwd_stream_bytes == dense.fwd_stream_bytes + m.fwd_stream_bytes
    assert t.bwd_wide_bytes == dense.bwd_wide_bytes  # rotation and q/k norms only, no dense MLP
    assert dense.fwd_wide_bytes == 2 * d * (128 + 64) * 2  # rotation and norm of q and k
    assert (t.fwd_kernels, t.bwd_kernels) == (FWD_KERNELS + 2 + MOE_KERNELS, BWD_KERNELS + 2 + MOE_KERNELS)


def test_fused_moe_block_drops_the_eager_ops(qwen3) -> None:  # noqa: ANN001
    """On Megatron's profile an MoE block is its GEMMs and attention plus the fused bytes; the HF
    file's routing, gathers, scatters and probability products are not priced one by one. autopar's
    own profile still prices every op the trace saw."""
    shape = Shape(b=2, s_ratio=1.0, kv_ratio=1.0, t=2, sp=2)
    fused = graph_region_time(qwen3, "block", MEGATRON, shape)
    eager = graph_region_time(qwen3, "block", dataclasses.replace(MEGATRON, fused_elementwise=False), shape)
    kernels = [op for op in qwen3.regions["block"].ops if op.kind in ("gemm", "attn")]
    fwd_k = sum(op_time_s(op, shape, MEGATRON, qwen3.seq_len)[0] for op in kernels if op.phase == "fwd")
    t = block_traffic(qwen3)
    bw = MEGATRON.memory_bandwidth_bytes_per_s * MEGATRON.memory_efficiency
    tokens = 2 * qwen3.seq_len
    assert fused.fwd_s == pytest.approx(fwd_k + tokens * (t.fwd_stream_bytes / 2 + t.fwd_wide_bytes / 2) / bw
                                        + t.fwd_kernels * MEGATRON.kernel_overhead_s)
    assert fused.fwd_s < eager.fwd_s and fused.bwd_s < eager.bwd_s
    assert not EAGER.fused_elementwise


def test_the_dispatcher_sorts_only_several_local_experts(qwen3) -> None:  # noqa: ANN001
    """Megatron's all-to-all dispatcher sorts the received rows by local expert and back: at ep 2
    (4 local experts) 2 x 2 k d h bytes per token each pass, at ep 8 (one local expert) and ep 1
    nothing; autopar's eager profile has no such kernels."""
    shape = Shape(b=1, s_ratio=1.0, kv_ratio=1.0, t=1, sp=1)
    assert sort_bytes_per_token(qwen3, 2) == 2 * 2 * 2 * 2 * 64
    assert sort_bytes_per_token(qwen3, 8) == sort_bytes_per_token(qwen3, 1) == 0.0
    bw = MEGATRON.memory_bandwidth_bytes_per_s * MEGATRON.memory_efficiency
    one = expert_sort_s(qwen3, MEGATRON, shape, 2, 1.0, 1.0)
    assert one == pytest.approx(qwen3.seq_len * 2 * 2 * 2 * 2 * 64 / bw + 2 * MEGATRON.kernel_overhead_s)
    assert expert_sort_s(qwen3, MEGATRON, shape, 2, 2.0, 1.5) == pytest.approx(
        (one - 2 * MEGATRON.kernel_overhead_s) * 1.5 / 2 + 2 * MEGATRON.kernel_overhead_s)
    assert expert_sort_s(qwen3, MEGATRON, shape, 8, 1.0, 1.0) == 0.0
    assert expert_sort_s(qwen3, EAGER, shape, 2, 1.0, 1.0) == 0.0


def test_blocks_not_of_that_form_keep_their_eager_pricing() -> None:
    """JetMoE's grouped stacks (its MoE module routes and scatters itself, with attention experts
    beside) are not Megatron's routed layer: no fused traffic, every traced op priced."""
    g = build_graph(str(ROOT / "examples/zoo/hf_jetmoe.py"), dtype="bf16")
    assert moe_widths(g) is None and block_traffic(g) is None


def test_the_sorts_enter_an_ep_plans_block_and_its_summary(qwen3) -> None:  # noqa: ANN001
    """At ep 2 (4 local experts of 8) the block's forward and backward carry one pass of the sorts each
    (and a full recompute's forward again); ``estimate --json``'s moe object says what they cost."""
    from autopar.cost.expert import moe_summary
    from autopar.cost.stage import Config, build_terms

    cfg = Config(dp=2, tp=1, pp=1, cp=1, cp_kind="", sequence_parallel=False, zero=1, recompute="none",
                 schedule="1f1b", virtual_stages=1, micro_batch=1, global_batch=4, seq_len=qwen3.seq_len,
                 dtype_bytes=2, optimizer="adam", ep=2)
    terms = build_terms(qwen3, MEGATRON, cfg)
    shape = Shape(b=1, s_ratio=1.0, kv_ratio=1.0, t=1, sp=1)
    one = expert_sort_s(qwen3, MEGATRON, shape, 2, 1.0, 1.0)
    assert terms.expert.sort_fwd_s == terms.expert.sort_bwd_s == pytest.approx(one) and one > 0
    plain = build_terms(qwen3, dataclasses.replace(MEGATRON, fused_elementwise=False), cfg)
    assert plain.expert.sort_fwd_s == 0.0
    summary = moe_summary(terms.expert, cfg, num_blocks=4)
    assert summary["expert_sort_s_per_step"] == pytest.approx(2 * one * 4 * cfg.num_microbatches)


def test_experts_the_tp_plan_shards_divide_their_activation_by_tp() -> None:
    """A plain-torch MoE whose TP plan shards the expert Linears (Megatron-Core's expert tensor
    parallelism): the activation over the rows is tp-sharded, the permutations are not."""
    g = build_graph(str(ROOT / "examples/zoo/torch_moe.py"), dtype="bf16")
    w = moe_widths(g)
    assert w.experts_sharded and (w.expert_in, w.expert_mid) == (2 * 96, 96)
    m = moe_traffic(w, 2)
    assert m.fwd_wide_bytes == 2 * 2 * (2 * 96 + 96) + SCORE_BYTES * 2
    assert m.fwd_stream_bytes == moe_traffic(dataclasses.replace(w, experts_sharded=False), 2).fwd_stream_bytes \
        - m.fwd_wide_bytes
