"""TP inferred from block 0's data flow (autopar.spec.tp_infer) equals the declared plans.

The reference models are built without their ``_tp_plan`` (a subclass that carries none), so the
spec must infer; Hugging Face models are compared against HF's own ``base_model_tp_plan`` as
autopar resolves it (transformers optional). A decoder with names nothing like Megatron's or HF's
(a fused key/value projection) and HF GPT-2 (Conv1D, a fused qkv split with a fixed width) must get
TP too.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.modelfile import load_model_file
from autopar.models.gpt import GPT_TP_PLAN
from autopar.models.llama import LLAMA_TP_PLAN
from autopar.spec import model_spec
from autopar.spec.tp_flow import trace_flow
from autopar.spec.tp_infer import pairs_of

MODELS = Path(__file__).resolve().parents[1] / "dist" / "models"  # shared with tests/dist/test_tp_foreign.py
ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"


def _file(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / f"{name}.py"
    p.write_text(textwrap.dedent(body))
    return p


def _spec(path: Path):
    return model_spec(load_model_file(path))


REF = '''
from autopar.models.gpt import GPT, GPTConfig, example_tokens, next_token_loss
from autopar.models.llama import Llama, LlamaConfig

class Plain{cls}({cls}):
    _tp_plan = None

CONFIG = {cfg}
SEQ_LEN = 16

def build_model():
    return Plain{cls}(CONFIG)

def example_inputs(micro_batch_size):
    return example_tokens(SEQ_LEN, CONFIG.vocab_size, micro_batch_size)

def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
'''


@pytest.mark.parametrize("fused", [False, True])
def test_gpt_without_tp_plan_infers_the_declared_plan(tmp_path: Path, fused: bool) -> None:
    cfg = f"GPTConfig(num_layers=2, hidden_size=32, num_heads=4, seq_len=16, vocab_size=64, fused_attention={fused})"
    spec = _spec(_file(tmp_path, f"gpt_{fused}", REF.format(cls="GPT", cfg=cfg)))
    assert spec.tp.source == "inferred", spec.tp.detail
    assert dict(spec.tp.styles) == GPT_TP_PLAN
    assert dict(spec.tp.fused) == {"attn.qkv": 3}
    assert "2 column->row pairs" in spec.tp.detail and "checked on CPU" in spec.tp.detail
    assert spec.supports("tp")


def test_llama_without_tp_plan_infers_the_declared_plan(tmp_path: Path) -> None:
    cfg = ("LlamaConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, "
           "seq_len=16, vocab_size=64)")
    spec = _spec(_file(tmp_path, "llama", REF.format(cls="Llama", cfg=cfg)))
    assert spec.tp.source == "inferred", spec.tp.detail
    assert dict(spec.tp.styles) == LLAMA_TP_PLAN
    assert dict(spec.tp.fused) == {}  # GQA k/v are narrower than q, not fused
    # Llama's config says heads; the data flow agrees (q 4 heads, k/v 2).
    assert (spec.num_heads, spec.num_kv_heads) == (4, 2)


def test_unusual_names_with_a_fused_kv_get_tp_and_heads_from_the_data_flow() -> None:
    spec = _spec(ZOO / "odd_names_decoder.py")
    assert dict(spec.tp.styles) == {"mix.query": "colwise", "mix.keyval": "colwise", "mix.out": "rowwise",
                                    "ffw.gate": "colwise", "ffw.up": "colwise", "ffw.down": "rowwise"}
    # keyval is (kv_heads, 2, head_dim): k and v of a head sit together, so no permutation is needed
    assert dict(spec.tp.fused) == {}
    assert (spec.num_heads, spec.num_kv_heads) == (4, 2)  # no config: read off the reshape of q and k


def test_hf_gpt2_conv1d_fused_qkv_and_per_rank_split_size() -> None:
    pytest.importorskip("transformers")
    spec = _spec(ZOO / "hf_gpt2.py")
    assert dict(spec.tp.styles) == {"attn.c_attn": "colwise", "attn.c_proj": "rowwise",
                                    "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}
    assert dict(spec.tp.fused) == {"attn.c_attn": 3}
    assert "attn.split_size" in spec.tp.local_attrs


def _hf_file(tmp_path: Path, name: str, cls: str, cfg_cls: str, cfg: str) -> Path:
    return _file(tmp_path, name, f'''
        import torch
        import torch.fx.experimental._config
        import transformers

        # eager MoE routing calls nonzero(); on meta, torch can assume every element non-zero
        torch.fx.experimental._config.meta_nonzero_assume_all_nonzero = True

        CONFIG = transformers.{cfg_cls}({cfg}, use_cache=False)
        SEQ_LEN = 16
        CARRY = True

        def build_model():
            m = transformers.{cls}(CONFIG)
            if not CARRY:
                m.config.base_model_tp_plan = None
                m._tp_plan = None
            return m

        def example_inputs(micro_batch_size):
            return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))

        def loss_fn(output, inputs):
            return output.logits.float().mean()
    ''')


HF = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig"),
}
HF_CFG = ("vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, "
          "num_key_value_heads=2, max_position_embeddings=16")


@pytest.mark.parametrize("name", sorted(HF))
def test_inferred_equals_hf_own_plan(tmp_path: Path, name: str) -> None:
    pytest.importorskip("transformers")
    cls, cfg_cls = HF[name]
    # eager experts: the grouped-mm kernel wants bf16 even on meta
    cfg = HF_CFG + (", num_local_experts=4, num_experts_per_tok=2, experts_implementation='eager'"
                    if name == "mixtral" else "")
    carried = _spec(_hf_file(tmp_path, f"{name}_carried", cls, cfg_cls, cfg))
    assert carried.tp.source == "model"
    path = _hf_file(tmp_path, f"{name}_bare", cls, cfg_cls, cfg)
    path.write_text(path.read_text().replace("CARRY = True", "CARRY = False"))
    inferred = _spec(path)
    assert inferred.tp.source == "inferred", inferred.tp.detail
    want = dict(carried.tp.styles)
    if name == "mixtral":  # the experts are not Linear layers: compare the attention part
        want = {k: v for k, v in want.items() if k.startswith("self_attn.")}
    assert dict(inferred.tp.styles) == want


class _Norm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


class _Bad(nn.Module):
    """fc1's features are normalised (mixed) before fc2: no pair; a head-wise attention output
    re-ordered across heads (kv heads tiled, not grouped) before o: no pair either."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm = _Norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(self.norm(self.fc1(x)))
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 2, 4).flip(2)  # the heads dim, reversed: rank 0 would need rank 1's head
        return y + self.o(q.reshape(b, s, 8))


def test_pairs_whose_features_mix_are_refused() -> None:
    block = _Bad().to("meta")
    x = torch.empty(1, 4, 8, device="meta")
    flow = trace_flow(block, block, lambda: block(x))
    pairs, notes = pairs_of(flow)
    assert pairs == []
    assert "is reduced by mean" in flow.bad["fc1"]
    assert "flip" in flow.bad["q"]


GPT_FILE = '''
import torch.nn.functional as F
from autopar.models.gpt import GPT, GPTConfig, example_tokens

CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_heads=4, seq_len=16, vocab_size=64)
SEQ_LEN = 16
VOCAB = 64
{extra}

def build_model():
    return GPT(CONFIG)

def example_inputs(micro_batch_size):
    return example_tokens(SEQ_LEN, VOCAB, micro_batch_size)

def loss_fn(output, inputs):
    {loss}
'''


def test_a_loss_with_the_vocabulary_constant_keeps_tp(tmp_path: Path) -> None:
    """logits.view(-1, VOCAB) fails on the planner's half-vocabulary meta logits; the executor's
    DTensor logits have the global shape, so TP must stay offered, with the head still priced
    vocab-parallel and the loss measured at full vocabulary."""
    from autopar.graph.measure import build_graph

    loss = "return F.cross_entropy(output[:, :-1].reshape(-1, VOCAB).float(), inputs[:, 1:].reshape(-1))"
    g = build_graph(_file(tmp_path, "gpt_vocab_loss", GPT_FILE.format(extra="", loss=loss)))
    assert g.support["tp"] is None, g.support["tp"]
    assert g.tp_styles == GPT_TP_PLAN
    head_gemms = [op for op in g.regions["post"].ops if op.kind == "gemm"]
    assert head_gemms and all(op.flops_exps.t == pytest.approx(1.0) for op in head_gemms)
    assert all(op.flops_exps.t == 0.0 for op in g.regions["loss"].ops)


def test_hf_style_patterns_resolve_the_same_in_planner_and_executor(tmp_path: Path) -> None:
    """``layers.*.x`` patterns (as HF writes them) become the block-relative plan that the graph
    (planner) shards and the executor's apply_tp / fused permutations read: one source."""
    from autopar.graph.build import one_block_model
    from autopar.graph.measure import build_graph
    from autopar.spec.tp_plan import fused_factors
    from autopar.spec.tp_shard import match_tp_style, shard_for_tp

    plan = "{" + ", ".join(f"'layers.*.{k}': '{v}'" for k, v in GPT_TP_PLAN.items()) + "}"
    loss = "return output.float().mean()"
    path = _file(tmp_path, "gpt_hf_patterns", GPT_FILE.format(extra=f"tp_plan = {plan}", loss=loss))
    mf = load_model_file(path)
    spec = model_spec(mf)
    assert spec.tp.source == "declared" and dict(spec.tp_plan) == GPT_TP_PLAN
    g = build_graph(path)
    assert g.tp_styles == GPT_TP_PLAN and g.support["tp"] is None
    model = mf.build("meta")
    block = model.layers[0]
    assert fused_factors(block, spec.tp_plan) == {"attn.qkv": 3, "mlp.fc1": 1}
    sharded = shard_for_tp(one_block_model(model, "layers"), "layers", spec.tp_plan, 2).layers[0]
    assert sharded.attn.qkv.out_features == 48 and sharded.attn.proj.in_features == 16
    assert sharded.mlp.fc1.out_features == 64 and sharded.mlp.fc2.in_features == 64
    # the planner's matcher also takes the HF form directly
    assert match_tp_style("attn.qkv", {"layers.*.attn.qkv": "colwise"}, "layers") == "colwise"


def test_conv1d_shards_in_the_planner() -> None:
    pytest.importorskip("transformers")
    from autopar.graph.build import one_block_model
    from autopar.spec.tp_shard import shard_for_tp

    mf = load_model_file(ZOO / "hf_gpt2.py")
    spec = model_spec(mf)
    model = mf.build("meta")
    small = one_block_model(model, spec.blocks_path)
    attn = shard_for_tp(small, spec.blocks_path, spec.tp_plan, 2, spec.tp.local_attrs).get_submodule(spec.blocks_path)[0].attn
    assert tuple(attn.c_attn.weight.shape) == (64, 96) and attn.c_attn.nf == 96 and tuple(attn.c_attn.bias.shape) == (96,)
    assert tuple(attn.c_proj.weight.shape) == (32, 64) and tuple(attn.c_proj.bias.shape) == (64,)
    assert attn.split_size == 32


def test_hf_styles_autopar_does_not_run_fall_back_to_inference(tmp_path: Path) -> None:
    """Phi-3 carries colwise_gather_output / rowwise_split_input, which autopar does not run; the data
    flow still shows its fused gate_up -> down pair (chunk(2)) and refuses the fused GQA qkv, whose
    q, k and v slices are of unequal widths."""
    pytest.importorskip("transformers")
    path = _hf_file(tmp_path, "phi3", "Phi3ForCausalLM", "Phi3Config", HF_CFG + ", pad_token_id=0")
    spec = _spec(path)
    assert spec.tp.source == "inferred", spec.tp.detail
    assert dict(spec.tp.styles) == {"mlp.gate_up_proj": "colwise", "mlp.down_proj": "rowwise"}
    assert dict(spec.tp.fused) == {"mlp.gate_up_proj": 2}
    assert any("colwise_gather_output" in n for n in spec.tp.dropped)
    assert any(n.startswith("self_attn.o_proj: not a row-parallel layer") for n in spec.tp.dropped)


ENCODER = '''
import torch
from torch import nn

SEQ_LEN = 8


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def build_model():
    return Encoder()


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, SEQ_LEN, dtype=torch.long)
'''


def test_transformer_encoder_shards_its_mlp_and_says_why_not_its_attention(tmp_path: Path) -> None:
    spec = _spec(_file(tmp_path, "encoder", ENCODER))
    assert dict(spec.tp.styles) == {"linear1": "colwise", "linear2": "rowwise"}
    assert any(n.startswith("self_attn: nn.MultiheadAttention") and "in_proj_weight" in n for n in spec.tp.dropped)


def test_fused_counts_come_from_the_data_flow_not_widths() -> None:
    from autopar.spec.tp_plan import fused_factors

    mf = load_model_file(MODELS / "fused_chunks.py")
    spec = _spec(MODELS / "fused_chunks.py")
    assert dict(spec.tp.fused) == {"qkv.proj": 3, "expand.proj": 2}
    block = mf.build("meta").cells[0]
    assert fused_factors(block, spec.tp_plan, spec.tp.fused)["expand.proj"] == 2
    assert fused_factors(block, spec.tp_plan)["expand.proj"] == 8  # what a width ratio would say


def test_inference_never_breaks_the_spec() -> None:
    from autopar.spec.tp_infer import infer_tp

    block = nn.Linear(4, 4)

    def run() -> None:
        raise RuntimeError("the user's forward broke")

    got = infer_tp(block, block, run)
    assert got.plan.styles == {} and "could not be read (RuntimeError: the user's forward broke)" in got.plan.detail


# ---- sequence parallelism: offered only where the executor's SP hooks run block 0 exactly (spec/sp_check.py)
_SP_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

W, H, V, S = 32, 4, 64, 16
SEQ_LEN = S


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(W, W) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, W // H).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.attn = nn.LayerNorm(W), Attn()

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return MIX


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, W)
        self.cells = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(W, V, bias=False)

    def forward(self, t):
        h = self.emb(t)
        for c in self.cells:
            h = c(h)
        return self.out(h)


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, S, dtype=torch.long)


def loss_fn(output, inputs):
    return F.cross_entropy(output.flatten(0, 1), inputs.flatten())
'''


def test_sp_offered_where_the_hooks_run_the_block_exactly(tmp_path) -> None:
    spec = _spec(_file(tmp_path, "sp_ok", _SP_MODEL.replace("MIX", "x")))
    assert spec.tp.source == "inferred" and spec.tp_plan == {"attn.q": "colwise", "attn.k": "colwise",
                                                             "attn.v": "colwise", "attn.o": "rowwise"}
    assert spec.support["sp"] is None
    assert _spec(ZOO / "odd_names_decoder.py").support["sp"] is None


def test_sp_refused_for_token_mixing_outside_the_gathered_parents(tmp_path) -> None:
    # a parameter-free mean over the sequence at block level: TP is exact, SP (each rank its shard) is not
    spec = _spec(_file(tmp_path, "sp_mix", _SP_MODEL.replace("MIX", "x - x.mean(dim=1, keepdim=True)")))
    assert spec.support["tp"] is None
    assert "simulated sequence-parallel block differs" in spec.support["sp"]


def test_sp_refused_for_an_unsharded_attention() -> None:
    # bare_pos_gpt's attention reshapes by the input's width, so only its MLP pair is sharded; under
    # SP its attention would run on each rank's sequence shard (and its weights meet DTensors)
    spec = _spec(ZOO / "bare_pos_gpt.py")
    assert spec.tp_plan == {"mlp.0": "colwise", "mlp.2": "rowwise"} and spec.support["tp"] is None
    assert spec.support["sp"].startswith("attn.c_attn.weight is in neither a tensor-parallel layer nor a norm")


def test_sp_refused_when_the_colwise_parent_is_never_called() -> None:
    # fused_chunks calls self.qkv.proj(...) directly: the SP gather hook on qkv would never run
    spec = _spec(MODELS / "fused_chunks.py")
    assert spec.support["tp"] is None
    assert "is never called" in spec.support["sp"] and "(the parent of colwise" in spec.support["sp"]


def test_an_attention_that_folds_heads_into_the_sequence_gets_its_head_count_divided(tmp_path: Path) -> None:
    """HF OPT views q as (b, -1, num_heads, head_dim): a tp shard passes the shape check with half the
    heads folded into the sequence, and only the numbers show it; dividing the attention's integer
    attributes makes the shard exact, so attention is sharded, not refused."""
    pytest.importorskip("transformers")
    path = _hf_file(tmp_path, "opt", "OPTForCausalLM", "OPTConfig",
                    "num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4, vocab_size=64, "
                    "max_position_embeddings=16, word_embed_proj_dim=32, dropout=0.0")
    spec = _spec(path)
    assert spec.tp.source == "inferred", spec.tp.detail
    assert dict(spec.tp.styles) == {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                                    "self_attn.v_proj": "colwise", "self_attn.out_proj": "rowwise",
                                    "fc1": "colwise", "fc2": "rowwise"}
    assert "self_attn.num_heads" in spec.tp.local_attrs


def test_multi_query_attention_says_why_tp_is_not_offered(tmp_path: Path) -> None:
    """One KV head: tp must divide the KV heads, so tp is not offered, with the reason (not a plan
    that every tp > 1 then refuses)."""
    pytest.importorskip("transformers")
    path = _hf_file(tmp_path, "bigcode", "GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                    "n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, multi_query=True, "
                    "resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0")
    spec = _spec(path)
    assert (spec.num_heads, spec.num_kv_heads) == (4, 1)
    assert "multi-query" in spec.support["tp"]


def test_a_block_too_large_for_the_numeric_check_picks_the_shard_that_keeps_the_sequence(tmp_path: Path) -> None:
    """Above the numeric check's size only shapes can tell: OPT's shard runs with and without its head
    count divided, and only the divided one keeps the sequence dim where the full block has it."""
    pytest.importorskip("transformers")
    path = _hf_file(tmp_path, "opt_big", "OPTForCausalLM", "OPTConfig",
                    "num_hidden_layers=2, hidden_size=1024, ffn_dim=4096, num_attention_heads=8, vocab_size=64, "
                    "max_position_embeddings=16, word_embed_proj_dim=1024, dropout=0.0")
    spec = _spec(path)
    assert "shapes checked" in spec.tp.detail  # the numeric check did not run at this size
    assert "self_attn.q_proj" in spec.tp.styles and "self_attn.num_heads" in spec.tp.local_attrs
