"""A layer's experts are no block list: a plain-torch decoder whose layers differ (dense first, then
mixture-of-experts) keeps one identical nn.ModuleList -- each MoE layer's experts -- and it had been
taken for the model's blocks (its tp plan read off one expert, its blocks the experts of layer 1)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

SOURCE = '''
import torch
from torch import nn
import torch.nn.functional as F

SEQ_LEN, VOCAB, H = 16, 64, 32


class Expert(nn.Module):
    def __init__(self, w=2):
        super().__init__()
        self.up, self.down = nn.Linear(H, w * H), nn.Linear(w * H, H)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    def __init__(self, w=2, n=4, k=2):
        super().__init__()
        self.router = nn.Linear(H, n, bias=False)
        self.experts = nn.ModuleList(Expert(w) for _ in range(n))
        self.k = k

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        w, idx = torch.topk(self.router(flat).softmax(-1), self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, expert(flat[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


class Layer(nn.Module):
    def __init__(self, moe, w=2):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.ffn = MoE(w) if moe else Expert()

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        LAYERS
        self.out = nn.Linear(H, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in ITERATE:
            x = layer(x)
        return self.out(x)


def build_model():
    return Model()


def example_inputs(micro_batch_size):
    return torch.randint(0, VOCAB, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return F.cross_entropy(output.reshape(-1, VOCAB), inputs.reshape(-1))
'''

LISTED = ("self.layers = nn.ModuleList([Layer(False), Layer(True), Layer(True)])", "self.layers")
DIFFERING = ("self.layers = nn.ModuleList([Layer(False), Layer(True), Layer(True, 3)])", "self.layers")
ATTRIBUTES = ("self.l0, self.l1, self.l2 = Layer(False), Layer(True), Layer(True)", "(self.l0, self.l1, self.l2)")


def _spec(tmp_path: Path, layout: tuple[str, str], name: str):
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(SOURCE).replace("LAYERS", layout[0]).replace("ITERATE", layout[1]))
    mf = load_model_file(path)
    return model_spec(mf, mf.build("meta"))


def test_layers_that_differ_are_the_chain_and_the_experts_stay_inside_them(tmp_path: Path) -> None:
    spec = _spec(tmp_path, LISTED, "listed_moe")
    assert spec.blocks_kind == "chain"
    assert spec.chain.units == ("layers.0", "layers.1", "layers.2")
    assert spec.expert_units == ("layers.1", "layers.2")
    assert spec.moe.experts_path == "ffn.experts" and spec.moe.num_experts == 4
    assert spec.support["ep"] is None  # expert parallelism shards the units that hold the experts


def test_units_whose_experts_differ_are_refused_ep_for_that_reason(tmp_path: Path) -> None:
    spec = _spec(tmp_path, DIFFERING, "differing_moe")
    assert spec.expert_units == ("layers.1", "layers.2") and spec.moe is None
    assert spec.support["ep"].startswith("the 2 units holding experts (layers.1, layers.2) differ in their experts")


def test_a_model_whose_only_lists_are_experts_has_no_block_list(tmp_path: Path) -> None:
    from autopar.errors import ModelFileError

    with pytest.raises(ModelFileError, match="found no list of repeated blocks"):
        _spec(tmp_path, ATTRIBUTES, "attribute_moe")
