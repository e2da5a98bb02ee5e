"""TP plans per unit kind of a chain of differing blocks (spec/chain_tp.py): each kind resolves its
own plan by the block precedence (declared, carried, inferred), and the first kind without one is
named in the tp refusal."""

from __future__ import annotations

from pathlib import Path

from autopar.modelfile import load_model_file
from autopar.spec import model_spec

MIXED = Path(__file__).resolve().parents[1] / "dist" / "models" / "mixed_blocks.py"


# the fixture's attention reshapes by the global head count; read off the tensor, it runs on a
# tp rank's heads (the data-flow check then keeps the attention pair)
_HEADS_FIXED = "view(b, s, 3, HEADS, DIM // HEADS)"
_HEADS_LOCAL = "view(b, s, 3, -1, DIM // HEADS)"


def _spec(tmp_path: Path, extra: str = "", *, local_heads: bool = True):
    src = MIXED.read_text()
    assert _HEADS_FIXED in src and "reshape(b, s, DIM)" in src
    if local_heads:
        src = src.replace(_HEADS_FIXED, _HEADS_LOCAL).replace("reshape(b, s, DIM)", "reshape(b, s, -1)")
    path = tmp_path / "mixed.py"
    path.write_text(src + extra)
    return model_spec(load_model_file(path))


def test_each_kind_of_a_mixed_block_list_infers_its_own_plan(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    assert spec.chain.kinds == (0, 0, 2, 2) and spec.tp.styles == {}
    dense, moe = spec.kind_tp
    assert (dense.unit, dense.count, moe.unit, moe.count) == ("layers.0", 2, "layers.2", 2)
    assert dense.plan.source == moe.plan.source == "inferred"
    assert dict(dense.plan.styles) == {"attn.qkv": "colwise", "attn.out": "rowwise", "mlp.up": "colwise",
                                       "mlp.down": "rowwise"}
    # the experts' grouped weights are no Linear pair: only the attention of the MoE kind is planned
    assert dict(moe.plan.styles) == {"attn.qkv": "colwise", "attn.out": "rowwise"}


def test_a_declared_plan_applies_to_each_kind_what_it_names_there(tmp_path: Path) -> None:
    declared = ('\ntp_plan = {"layers.*.attn.qkv": "colwise", "layers.*.attn.out": "rowwise", '
                '"mlp.up": "colwise", "mlp.down": "rowwise"}\n')
    dense, moe = _spec(tmp_path, declared).kind_tp
    assert dense.plan.source == moe.plan.source == "declared"
    assert set(dense.plan.styles) == {"attn.qkv", "attn.out", "mlp.up", "mlp.down"}
    assert set(moe.plan.styles) == {"attn.qkv", "attn.out"}


def test_the_refusal_names_the_first_kind_without_a_plan(tmp_path: Path) -> None:
    # heads by the global count: the dense kind keeps its MLP pair, the MoE kind has no pair left
    spec = _spec(tmp_path, local_heads=False)
    dense, moe = spec.kind_tp
    assert dict(dense.plan.styles) == {"mlp.up": "colwise", "mlp.down": "rowwise"} and not moe.plan.styles
    why = spec.support_reason("tp")
    assert why is not None and "unit kind layers.2 (2 of the chain's units) has no tp plan" in why
    assert "\n" not in why


def test_the_chain_is_measured_and_priced_under_each_kinds_plan(tmp_path: Path) -> None:
    import dataclasses

    from autopar.cluster import load_cluster
    from autopar.cost.chain import build_chain_terms
    from autopar.cost.stage import Config
    from autopar.graph import build_graph

    spec = _spec(tmp_path)
    assert spec.support_reason("tp") is None
    # sp: the MoE units would route their sequence shard (allowed), but the dense kind's block does
    # not run on a shard exactly (its position table is added inside the unit)
    assert spec.support_reason("sp").startswith("unit kind layers.0: the simulated sequence-parallel block")
    graph = build_graph(load_model_file(tmp_path / "mixed.py"), dtype="fp32")  # its pos table is fp32
    assert graph.tp_reason is None and graph.tp_source.startswith("per unit kind")
    # each kind's region holds its own collectives: dense 2 pairs, MoE 1 (its attention)
    fwd = {k: sum(q.phase == "fwd" for q in graph.regions[f"unit.{k}"].comm) for k in (0, 2)}
    assert fwd == {0: 2, 2: 1}
    cfg = Config(dp=1, tp=1, pp=1, cp=1, cp_kind="ring", sequence_parallel=False, zero=0, recompute="none",
                 schedule="1f1b", virtual_stages=1, micro_batch=1, global_batch=8, seq_len=16, dtype_bytes=2,
                 optimizer="adamw")
    cluster = load_cluster("a100-80g")
    one, two = (build_chain_terms(graph, cluster, dataclasses.replace(cfg, tp=t)) for t in (1, 2))
    for u1, u2 in zip(one.units, two.units):
        assert u2.fwd_flops < u1.fwd_flops and u2.params < u1.params  # sharded work and weights
        assert u1.tp_comm_s == 0.0 < u2.tp_comm_s
    sp = build_chain_terms(graph, cluster, dataclasses.replace(cfg, tp=2, sequence_parallel=True))
    assert all(u3.act_bytes < u2.act_bytes for u2, u3 in zip(two.units, sp.units))  # norms on a shard
    # the MoE kind's experts stay whole on every tp rank: it keeps more of its parameters than the dense
    dense, moe = two.units[0].params / one.units[0].params, two.units[2].params / one.units[2].params
    assert 0.5 < dense < moe < 1.0


WIDENING = '''
import torch
from torch import nn

SEQ_LEN = 8
WIDTHS = (16, 32, 64, 64)


class Stage(nn.Module):
    """A stage of a hierarchical model: widened at its entry, then an MLP at its width."""

    def __init__(self, d_in, d):
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        x = self.proj(x)
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, WIDTHS[0])
        self.stages = nn.ModuleList(Stage(a, b) for a, b in zip((WIDTHS[0],) + WIDTHS[:-1], WIDTHS))
        self.norm = nn.LayerNorm(WIDTHS[-1])
        self.head = nn.Linear(WIDTHS[-1], 64)

    def forward(self, ids):
        x = self.embed(ids)
        for stage in self.stages:
            x = stage(x)
        return self.head(self.norm(x))


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randint(0, 64, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return output.float().square().mean()
'''


def test_a_unit_of_widening_stages_is_probed_in_the_whole_run(tmp_path: Path) -> None:
    # Hiera's stages widen: a probe that answers the other stages with stage 0's output hands the
    # final norm the wrong width; the probe then runs the whole model (spec.__init__ ``focused``)
    path = tmp_path / "widening.py"
    path.write_text(WIDENING)
    spec = model_spec(load_model_file(path))
    assert spec.chain is not None and spec.support_reason("tp") is None, spec.support_reason("tp")
    for kind in spec.kind_tp:
        assert kind.plan.source == "inferred" and dict(kind.plan.styles) == {"fc1": "colwise", "fc2": "rowwise"}


def test_a_module_holding_its_forwards_state_is_copied_for_the_probes() -> None:
    import copy

    import pytest
    import torch
    from torch import nn

    from autopar.spec.module_copy import copy_module

    class Recurrent(nn.Module):
        """RecurrentGemma's RG-LRU keeps the state its forward computed as an attribute."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.state = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.state = self.lin(x)
            return self.state

    m = Recurrent()
    m(torch.ones(2, 4))
    with pytest.raises(RuntimeError):
        copy.deepcopy(m)
    c = copy_module(m)
    assert c.lin.weight is not m.lin.weight and torch.equal(c.lin.weight, m.lin.weight)
    assert c.state.grad_fn is None and torch.equal(c.state, m.state.detach())


HEADED = WIDENING.replace('''class Stage(nn.Module):
    """A stage of a hierarchical model: widened at its entry, then an MLP at its width."""

    def __init__(self, d_in, d):
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        x = self.proj(x)
        return x + self.fc2(torch.relu(self.fc1(x)))''', '''class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Stage(nn.Module):
    """A stage of a hierarchical model: widened at its entry, attention with its own head count
    (one in the first stage, as Hiera's), then an MLP at its width."""

    def __init__(self, d_in, d):
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.attn = Attention(d, d // 16)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        x = self.proj(x)
        x = x + self.attn(x)
        return x + self.fc2(torch.relu(self.fc1(x)))''')


def test_tp_divides_the_heads_of_the_attention_it_shards_only(tmp_path: Path) -> None:
    # stage 0's one head keeps its attention whole (its MLP sharded); tp 2 divides every sharded
    # attention's heads (2, 4, 4): the degree rule must not take stage 0's head count for the model's
    path = tmp_path / "headed.py"
    path.write_text(HEADED)
    spec = model_spec(load_model_file(path))
    first = spec.kind_tp[0]
    assert "attn.qkv" not in first.plan.styles and "fc1" in first.plan.styles
    assert all("attn.qkv" in k.plan.styles for k in spec.kind_tp[1:])
    assert spec.tp_degrees.num_heads == 2 and spec.tp_degrees.reason(2) is None
    assert spec.tp_degrees.reason(4) is not None  # stage 1's two heads
