"""Megatron's element-wise work priced as its fused kernels move it, and a context-parallel rank's
attention priced as the flash pieces its software runs (autopar.cost.fused_elementwise,
autopar.cost.compute._attention_s)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster import ClusterError, load_cluster
from autopar.cost.compute import graph_region_time, op_time_s
from autopar.cost.fused_elementwise import BWD_KERNELS, FWD_KERNELS, block_traffic, rotates, traffic_of
from autopar.cost.megatron_memory import layer_widths
from autopar.graph import build_graph
from autopar.graph.scaling import Shape
from autopar.models.gpt import GPTConfig
from autopar.models.llama import LlamaConfig
from autopar.reference import gpt_graph
from autopar.reference_h100 import model_path

MEGATRON = load_cluster("h100-80g-megatron")
EAGER = load_cluster("h100-80g")


@pytest.fixture(scope="module")
def llama():  # noqa: ANN201
    cfg = LlamaConfig(num_layers=2, hidden_size=1024, num_heads=8, num_kv_heads=2, ffn_hidden_size=2816,
                      seq_len=2048, vocab_size=1024)
    return build_graph(str(model_path(cfg)), dtype="bf16")


@pytest.fixture(scope="module")
def gpt():  # noqa: ANN201
    return gpt_graph(GPTConfig(num_layers=2, hidden_size=1024, num_heads=8, seq_len=2048, vocab_size=1024,
                               fused_attention=True), "bf16")


def test_the_rotation_is_found_by_behaviour(llama, gpt) -> None:  # noqa: ANN001
    """RoPE (element-wise work on q and k between their projections and the kernel) in Llama; GPT's
    learned positions are added before the block."""
    assert rotates(llama) and not rotates(gpt)


def test_traffic_follows_the_widths(llama) -> None:  # noqa: ANN001
    w = layer_widths(llama)
    assert (w.hidden, w.attn_in, w.attn_out, w.mlp_in, w.mlp_mid) == (1024, 1024 + 2 * 256, 1024, 2 * 2816, 2816)
    t = block_traffic(llama)
    d = 2
    assert t == traffic_of(w, d, True)
    assert t.fwd_stream_bytes == 10 * d * 1024  # two norms, two residual adds, no dropout
    assert t.fwd_wide_bytes == 2 * d * (1024 + 256) + d * 3 * 2816  # rotation of q and k, SwiGLU
    assert t.bwd_wide_bytes == 2 * d * (1024 + 256) + d * (2 * 2 * 2816 + 2816)


def test_fused_block_is_the_gemms_attention_and_fused_bytes(llama) -> None:  # noqa: ANN001
    """With fused element-wise kernels a block's time is its GEMMs and attention, as eagerly priced,
    plus the fused traffic at the HBM share; the model file's dozens of eager element-wise ops
    (an fp32 RMSNorm alone is six) are not priced, and sharding by tp / sp divides the right parts."""
    shape = Shape(b=2, s_ratio=1.0, kv_ratio=1.0, t=2, sp=2)
    fused = graph_region_time(llama, "block", MEGATRON, shape)
    eager = graph_region_time(llama, "block", dataclasses.replace(MEGATRON, fused_elementwise=False), shape)
    kernels = [op for op in llama.regions["block"].ops if op.kind in ("gemm", "attn")]
    fwd_k = sum(op_time_s(op, shape, MEGATRON, llama.seq_len)[0] for op in kernels if op.phase == "fwd")
    bwd_k = sum(op_time_s(op, shape, MEGATRON, llama.seq_len)[0] for op in kernels if op.phase == "bwd")
    t = block_traffic(llama)
    bw = MEGATRON.memory_bandwidth_bytes_per_s * MEGATRON.memory_efficiency
    tokens = 2 * llama.seq_len
    assert fused.fwd_s == pytest.approx(fwd_k + tokens * (t.fwd_stream_bytes / 2 + t.fwd_wide_bytes / 2) / bw
                                        + FWD_KERNELS * MEGATRON.kernel_overhead_s)
    assert fused.bwd_s == pytest.approx(bwd_k + tokens * (t.bwd_stream_bytes / 2 + t.bwd_wide_bytes / 2) / bw
                                        + BWD_KERNELS * MEGATRON.kernel_overhead_s)
    assert fused.fwd_s < eager.fwd_s and fused.bwd_s < eager.bwd_s
    # autopar run executes the file eagerly: its profile prices every op the trace saw
    assert not EAGER.fused_elementwise


def _attn(graph, phase: str):  # noqa: ANN001, ANN202
    return next(op for op in graph.regions["block"].ops if op.kind == "attn" and op.phase == phase)


@pytest.mark.parametrize("phase", ["fwd", "bwd"])
def test_context_parallel_attention_is_priced_per_piece(llama, phase: str) -> None:  # noqa: ANN001
    """cp 2 of 8k tokens: autopar's ring runs 2 causal and 3 full pieces of 2k keys; TE's ring one
    causal piece of 4k and one full piece of 4k queries against 2k keys. Each piece at its own key
    length's rate; without CP the whole op at the whole length, as before."""
    op = _attn(llama, phase)
    assert op.causal
    S = llama.seq_len
    cp, s = 2, 8192
    core = Shape(b=1, s_ratio=s / cp / S, kv_ratio=s / S, t=1)
    flops = op.flops * core.scale(op.flops_exps)
    unit = flops / (s / cp * s)
    hd, bwd = op.dims[3], phase == "bwd"

    def rate(c, kv: float, causal: bool) -> float:  # noqa: ANN001
        return c.attention_flops_per_s(kv, head_dim=hd, causal=causal, backward=bwd)

    c = s / (2 * cp)
    ours = 3 * unit * c * c / rate(EAGER, c, False) + 2 * unit * c * c / rate(EAGER, c, True)
    assert op_time_s(op, core, EAGER, S)[0] == pytest.approx(ours + 5 * EAGER.kernel_overhead_s)
    te = unit * (2 * c) ** 2 / rate(MEGATRON, 2 * c, True) + unit * 2 * c * c / rate(MEGATRON, c, False)
    assert op_time_s(op, core, MEGATRON, S)[0] == pytest.approx(te + 2 * MEGATRON.kernel_overhead_s)
    whole = Shape(b=1, s_ratio=s / S, kv_ratio=s / S, t=1)
    w_flops = op.flops * whole.scale(op.flops_exps)
    assert op_time_s(op, whole, EAGER, S)[0] == pytest.approx(w_flops / rate(EAGER, s, True) + EAGER.kernel_overhead_s)
    # shorter pieces run slower than the whole key length would: cp 8 of 8k tokens is 512-key pieces
    core8 = Shape(b=1, s_ratio=s / 8 / S, kv_ratio=s / S, t=1)
    f8 = op.flops * core8.scale(op.flops_exps)
    assert op_time_s(op, core8, EAGER, S)[0] > f8 / 2 / rate(EAGER, s, True)


def test_cp_attention_setting_is_checked(tmp_path) -> None:  # noqa: ANN001
    f = tmp_path / "p.yaml"
    f.write_text("name: p\nbase: h100-80g\nsoftware:\n  cp_attention: zigzag\n")
    with pytest.raises(ClusterError, match="'cp_attention' must be one of chunks, transformer_engine"):
        load_cluster(str(f))


def test_transformer_engines_ring_hides_its_transfers_behind_the_pieces(llama) -> None:  # noqa: ANN001
    """TE's P2P ring sends the next K/V block while the current piece runs: only what outlasts the
    attention shows (plus the hidden part's share of SMs); autopar's ring waits for every block."""
    from autopar.cost.stage import Config, build_terms
    from autopar.cost.zero import overlapped

    cfg = Config(dp=1, tp=1, pp=1, cp=2, cp_kind="ring", sequence_parallel=False, zero=1, recompute="none",
                 schedule="1f1b", virtual_stages=1, micro_batch=1, global_batch=1, seq_len=8192, dtype_bytes=2,
                 optimizer="adam")
    waits = dataclasses.replace(MEGATRON, cp_attention="chunks")
    exposed = build_terms(llama, waits, cfg).block.cp_comm_s
    hidden = build_terms(llama, MEGATRON, cfg).block.cp_comm_s
    assert 0 < hidden < exposed
    # the same transfers, each pass behind its attention core
    shape = Shape(b=1, s_ratio=8192 / 2 / llama.seq_len, kv_ratio=8192 / llama.seq_len, t=1)
    rt = graph_region_time(llama, "block", MEGATRON, shape, shape, 2, "ring")
    fwd_comm = build_terms(llama, dataclasses.replace(waits, cp_attention="transformer_engine",
                                                      overlap_cost_fraction=1.0), cfg).block.cp_comm_s
    assert fwd_comm == pytest.approx(exposed)  # a cost fraction of 1: hiding saves nothing
    from autopar.cost.comm import axis_link
    from autopar.cost.stage import _cp_time
    from autopar.layout import Layout

    tokens_bytes = llama.block_input_bytes * shape.s_ratio
    cp_f, cp_b = _cp_time(llama, cfg, axis_link(MEGATRON, Layout.of(cfg), "cp"), tokens_bytes)
    assert cp_f + cp_b == pytest.approx(exposed)
    f = MEGATRON.overlap_cost_fraction
    assert hidden == pytest.approx(overlapped(cp_f, rt.core_fwd_s, f) + overlapped(cp_b, rt.core_bwd_s, f))
