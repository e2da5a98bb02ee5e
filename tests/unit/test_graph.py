"""The graph model: nodes and cut points, FLOPs against FlopCounterMode, parameters, measured saved bytes,
repeated blocks, TP applicability (heads, GQA kv heads, non-transformers) and the 1T-parameter load time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autopar.errors import PlanError
from autopar.graph import build_graph
from autopar.graph.scaling import Shape
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.llama import model_file as llama_model_file
from autopar.reference import gpt_graph

SPLIT_KEYS = {"tp_sharded", "sp_sharded", "attention_core", "other"}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def tiny_cfg() -> GPTConfig:
    return GPTConfig(num_layers=3, hidden_size=256, num_heads=8, seq_len=128, vocab_size=1000)


@pytest.fixture(scope="module")
def tiny(tiny_cfg: GPTConfig):
    return gpt_graph(tiny_cfg, "fp32")


@pytest.fixture(scope="module")
def llama_cfg() -> LlamaConfig:
    return LlamaConfig(num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2, ffn_hidden_size=512,
                       seq_len=128, vocab_size=1000)


@pytest.fixture(scope="module")
def llama(llama_cfg: LlamaConfig, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("llama") / "llama_gqa.py"
    path.write_text(llama_model_file(llama_cfg))
    return build_graph(str(path), dtype="bf16")


# ---------------------------------------------------------------- structure


def test_nodes_in_execution_order_and_edges_form_a_chain(tiny) -> None:
    g = tiny.graph
    names = ["embedding", "block.0", "block.1", "block.2", "head", "loss"]
    assert list(g.nodes) == names
    assert [g.nodes[n]["index"] for n in names] == list(range(len(names)))
    assert [g.nodes[n]["kind"] for n in names] == ["pre", "block", "block", "block", "post", "loss"]
    assert set(g.edges) == set(zip(names, names[1:]))
    for u, v in g.edges:
        assert g.edges[u, v]["cut_point"] == (u.startswith("block.") and v.startswith("block.")), (u, v)
    assert [e for e in g.edges if g.edges[e]["cut_point"]] == [("block.0", "block.1"), ("block.1", "block.2")]
    import networkx as nx
    assert nx.is_directed_acyclic_graph(g) and list(nx.topological_sort(g)) == names


@pytest.mark.parametrize("layers", [1, 5, 40])
def test_repeated_blocks_recognised(layers: int) -> None:
    cfg = GPTConfig(num_layers=layers, hidden_size=128, num_heads=4, seq_len=64, vocab_size=300)
    g = gpt_graph(cfg, "bf16")
    assert g.num_blocks == layers
    blocks = [n for n in g.graph.nodes if n.startswith("block.")]
    assert blocks == [f"block.{i}" for i in range(layers)]
    # One block is measured and stands for all: identical per-block numbers whatever the depth.
    ref = gpt_graph(GPTConfig(num_layers=2, hidden_size=128, num_heads=4, seq_len=64, vocab_size=300), "bf16")
    for key in ("fwd_flops", "bwd_flops", "saved_bytes", "num_params"):
        assert g.graph.nodes[f"block.{layers - 1}"][key] == ref.graph.nodes["block.0"][key]


def test_blocks_found_without_pipeline_blocks_declaration(tmp_path: Path) -> None:
    path = tmp_path / "undeclared.py"
    path.write_text(
        "from autopar.models.gpt import GPT, GPTConfig, example_tokens\n"
        "CONFIG = GPTConfig(num_layers=6, hidden_size=64, num_heads=4, seq_len=32, vocab_size=128)\n"
        "SEQ_LEN = 32\n"
        "def build_model():\n    return GPT(CONFIG)\n"
        "def example_inputs(n):\n    return example_tokens(32, 128, n)\n")
    g = build_graph(str(path), dtype="fp32")
    assert g.num_blocks == 6
    # No tp_plan line: the reference GPT carries its own plan (_tp_plan, as HF models do), so TP is
    # offered and the graph says where the plan came from.
    assert g.tp_reason is None and g.tp_allowed(2) is None
    assert "model: _tp_plan" in g.tp_source
    from autopar.models.gpt import GPT_TP_PLAN

    assert dict(g.tp_styles) == GPT_TP_PLAN


# ---------------------------------------------------------------- FLOPs


def test_block_flops_equal_flop_counter_mode(tiny, tiny_cfg: GPTConfig) -> None:
    """The GPT's explicit attention (matmul, softmax, dropout, matmul) runs the same kernels on meta as on
    CUDA, so the graph's forward+backward FLOPs of a block must equal FlopCounterMode's count exactly."""
    with torch.device("meta"):
        model = GPT(tiny_cfg)
    x = torch.randn(1, tiny_cfg.seq_len, tiny_cfg.hidden_size, device="meta", requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        model.layers[0](x).sum().backward()
    node = tiny.graph.nodes["block.1"]
    assert node["fwd_flops"] + node["bwd_flops"] == fc.get_total_flops()
    s, h = tiny_cfg.seq_len, tiny_cfg.hidden_size
    # Megatron's count: forward 24 s h^2 + 4 s^2 h, backward twice that.
    assert node["fwd_flops"] == 24 * s * h * h + 4 * s * s * h
    assert node["bwd_flops"] == 2 * node["fwd_flops"]


def test_head_flops_are_the_vocab_gemm(tiny, tiny_cfg: GPTConfig) -> None:
    s, h, v = tiny_cfg.seq_len, tiny_cfg.hidden_size, tiny_cfg.vocab_size
    head = tiny.graph.nodes["head"]
    assert head["fwd_flops"] == 2 * s * h * v and head["bwd_flops"] == 4 * s * h * v
    assert tiny.model_flops_per_sample() == sum(d["fwd_flops"] + d["bwd_flops"] for _, d in tiny.graph.nodes(data=True))


def test_llama_block_gemm_flops_equal_flop_counter_mode(llama, llama_cfg: LlamaConfig) -> None:
    """Llama attention is SDPA: autopar counts the flash kernel CUDA runs (its backward recomputes QK^T),
    FlopCounterMode on CPU-meta the math fallback, so compare the projection/MLP GEMMs (aten.mm)."""
    with torch.device("meta"):
        model = Llama(llama_cfg).to(torch.bfloat16)
    x = torch.randn(1, llama_cfg.seq_len, llama_cfg.hidden_size, device="meta", dtype=torch.bfloat16,
                    requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        model.layers[0](x).sum().backward()
    counted_mm = sum(v for k, v in fc.get_flop_counts()["Global"].items() if str(k) == "aten.mm")
    graph_mm = sum(op.flops for op in llama.regions["block"].ops if op.kind == "gemm" and op.dims[0] == 1)
    assert graph_mm == counted_mm
    attn = sum(op.flops for op in llama.regions["block"].ops if op.kind == "attn")
    s, h = llama_cfg.seq_len, llama_cfg.hidden_size
    assert attn == pytest.approx(4 * s * s * h * (1 + 2.5), rel=1e-9)  # flash fwd 2 GEMMs, bwd 5


# ---------------------------------------------------------------- parameters


def test_parameter_counts(tiny, tiny_cfg: GPTConfig) -> None:
    h, v, s = tiny_cfg.hidden_size, tiny_cfg.vocab_size, tiny_cfg.seq_len
    with torch.device("meta"):
        model = GPT(tiny_cfg)
    assert tiny.num_params == sum(p.numel() for p in model.parameters())  # tied weight counted once
    assert tiny.params["block"].count == 12 * h * h + 13 * h
    assert tiny.params["block"].tp_sharded == 12 * h * h + 7 * h  # qkv, fc1 (+bias), proj, fc2 weights
    assert tiny.params["pre"].count == v * h + s * h
    assert tiny.params["pre"].tp_sharded == v * h  # vocab-parallel embedding; positions replicated
    assert tiny.tied_params == v * h
    assert tiny.graph.nodes["block.0"]["num_params"] == tiny.params["block"].count
    for tp in (1, 2, 4, 8):
        assert tiny.params["block"].per_rank(tp) == pytest.approx((12 * h * h + 7 * h) / tp + 6 * h)


def test_llama_gqa_heads_and_parameters(llama, llama_cfg: LlamaConfig) -> None:
    h, kv, d, f = llama_cfg.hidden_size, llama_cfg.num_kv_heads, llama_cfg.head_dim, llama_cfg.ffn_hidden_size
    assert (llama.num_heads, llama.num_kv_heads) == (8, 2)
    assert llama.params["block"].count == 2 * h * h + 2 * h * kv * d + 3 * h * f + 2 * h
    assert llama.params["block"].tp_sharded == 2 * h * h + 2 * h * kv * d + 3 * h * f
    assert llama.tp_allowed(2) is None
    assert "key/value heads" in llama.tp_allowed(4)  # 8 query heads would split 4 ways, 2 kv heads cannot
    assert llama.ulysses_allowed(1, 2) is None and "key/value heads" in llama.ulysses_allowed(2, 2)


def test_tp_must_divide_the_heads(data_dir: Path, a100, make_plan) -> None:
    from autopar.cost.estimate import estimate_plan

    g = build_graph(str(data_dir / "models" / "gpt12.py"), dtype="bf16")
    assert g.num_heads == 12
    assert g.tp_allowed(4) is None and g.tp_allowed(6) is None
    reason = g.tp_allowed(8)
    assert reason and "12" in reason and "heads" in reason
    with pytest.raises(PlanError, match="parallel.tp"):
        estimate_plan(make_plan(4, seq_len=64, global_batch_size=8, tp=8), g, a100)


def test_non_transformer_gets_inferred_tp_and_a_cp_reason(repo: Path) -> None:
    g = build_graph(str(repo / "examples" / "mlp.py"), dtype="fp32")
    assert g.num_blocks == 12 and not g.is_sequence_model and g.seq_len == 1
    # nothing declared: fc1 -> relu -> fc2 is a column->row pair in the data flow (spec/tp_infer.py)
    assert g.tp_reason is None and g.tp_styles == {"fc1": "colwise", "fc2": "rowwise"}
    assert "inferred" in g.tp_source
    assert g.tp_allowed(2) is None and g.tp_allowed(1) is None
    assert g.cp_reason
    assert g.num_heads is None
    # fwd FLOPs of a residual MLP block: fc1 and fc2, 2 * (w * 2w) each, per sample.
    assert g.graph.nodes["block.0"]["fwd_flops"] == 2 * 2 * 512 * 1024


# ---------------------------------------------------------------- saved bytes


def test_saved_bytes_split(tiny) -> None:
    for name, data in tiny.graph.nodes(data=True):
        assert set(data["saved_split"]) == SPLIT_KEYS, name
        assert sum(data["saved_split"].values()) == pytest.approx(data["saved_bytes"]), name
        assert data["saved_bytes"] >= 0


def test_gpt_block_saved_bytes_match_korthikanti_terms() -> None:
    """Korthikanti et al. 2022 §4: per layer (16-bit) 10 sbh replicated across tp (layer-norm inputs, QKV and
    fc1 inputs, dropout masks), 24 sbh divided by tp, 5 a s^2 b in the attention core (softmax output,
    dropout mask and output); the measured explicit attention also keeps the s x s boolean causal mask."""
    s, h, a = 256, 512, 16
    g = gpt_graph(GPTConfig(num_layers=2, hidden_size=h, num_heads=a, seq_len=s, vocab_size=1000), "fp16")
    split = g.graph.nodes["block.0"]["saved_split"]
    sbh = s * h
    assert split["tp_sharded"] == pytest.approx(24 * sbh, rel=1e-3)
    assert split["sp_sharded"] == pytest.approx(10 * sbh, rel=1e-2)
    assert 5 * a * s * s <= split["attention_core"] <= 5 * a * s * s + s * s
    assert split["other"] < 0.01 * sbh
    assert g.block_input_bytes == 2 * sbh  # what full recompute keeps


def test_tensor_parallel_collectives_per_block() -> None:
    """Megatron TP: 2 all-reduces of the b x s x h activation in forward and 2 in backward per layer."""
    s, h = 128, 256
    g = gpt_graph(GPTConfig(num_layers=2, hidden_size=h, num_heads=8, seq_len=s, vocab_size=500), "bf16")
    comm = g.regions["block"].comm
    assert sorted(q.phase for q in comm) == ["bwd", "bwd", "fwd", "fwd"]
    assert all(q.what == "tp_allreduce" and q.nbytes == s * h * 2 for q in comm)
    shape = Shape(b=4, s_ratio=0.5, kv_ratio=0.5, t=8)
    assert all(q.nbytes * shape.scale(q.exps) == 4 * (s // 2) * h * 2 for q in comm)  # not divided by tp


def test_saved_bytes_scale_with_batch_sequence_and_tp() -> None:
    """Saved bytes grow linearly in the micro-batch, the attention core quadratically in the sequence, and
    tp divides the sharded part. The causal bias is additive, so nothing s x s outside the heads is kept."""
    s = 256
    g = gpt_graph(GPTConfig(num_layers=2, hidden_size=256, num_heads=8, seq_len=s, vocab_size=500), "bf16")
    fit = g.regions["block"]
    split = g.graph.nodes["block.0"]["saved_split"]
    base = sum(q.nbytes for q in fit.saved)
    core = split["attention_core"]

    def at(**kw: float) -> float:
        shape = Shape(**{"b": 1, "s_ratio": 1.0, "kv_ratio": 1.0, "t": 1, **kw})
        return sum(q.nbytes * shape.scale(q.exps) for q in fit.saved)

    assert at() == base
    assert at(b=3) == pytest.approx(3 * base)
    assert at(s_ratio=0.5, kv_ratio=0.5) == pytest.approx((base - core) / 2 + core / 4)
    assert at(t=4) == pytest.approx(split["sp_sharded"] + split["other"] + (split["tp_sharded"] + core) / 4)


# ---------------------------------------------------------------- scale


def test_one_trillion_parameter_gpt_loads_graphs_and_estimates(a100) -> None:
    """Megatron's 1T GPT (128 layers, hidden 25600, 160 heads): load, graph and estimate (its time
    is a benchmark's business: benchmarks/search_time.py; this machine is shared and noisy)."""
    from autopar.cost.estimate import estimate_plan
    from autopar.modelfile import load_model_file
    from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training
    from autopar.reference import gpt_model_path

    cfg = GPTConfig(num_layers=128, hidden_size=25600, num_heads=160, seq_len=2048, vocab_size=51200)
    path = gpt_model_path(cfg)
    mf = load_model_file(path)
    graph = build_graph(mf, dtype="bf16")
    plan = Plan(model=ModelRef(file=str(path), num_blocks=128),
                cluster=ClusterRef(profile="a100-80g", num_gpus=3072, gpus_per_node=8),
                training=Training(global_batch_size=3072, micro_batch_size=1, seq_len=2048),
                parallel=Parallel(dp=6, tp=8, pp=64, sequence_parallel=True, recompute="selective"))
    est = estimate_plan(plan, graph, a100)
    assert graph.num_params == pytest.approx(1.008e12, rel=0.01)
    assert graph.num_blocks == 128 and len(graph.graph) == 128 + 3
    assert est.step_time_s > 0 and 0 < est.mfu < 1 and est.peak_memory_bytes > 0
