"""Blocks in a numbered ``nn.ModuleDict`` (torchtitan's ``layers``) are a block list like a ModuleList:
found, indexed, cut to one block for the trace and split into pipeline chunks, while the model's own
forward keeps the dict's calls; torchtitan's complex rotary embedding (``view_as_complex`` /
``view_as_real``) keeps the attention's column->row pair for inferred tensor parallelism."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.block_dict import BlockDict, adopt_block_dicts
from autopar.modelfile import load_model_file
from autopar.spec import model_spec

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"
TITAN = ZOO / "torch_titan_llama.py"


class _Net(nn.Module):
    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({k: nn.Linear(4, 4) for k in keys})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def test_only_plain_dicts_keyed_0_to_n_minus_1_are_adopted() -> None:
    numbered, named = _Net(["0", "1", "2"]), _Net(["a", "b"])
    assert adopt_block_dicts(numbered) == 1 and adopt_block_dicts(named) == 0
    assert type(numbered.layers) is BlockDict and type(named.layers) is nn.ModuleDict
    assert adopt_block_dicts(_Net(["1", "0"])) == 0  # out of order: not a list's numbering


def test_a_block_dict_answers_a_dict_and_a_list_alike() -> None:
    net = _Net(["0", "1", "2"])
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(2, 4)
    want = net(x)
    adopt_block_dicts(net)
    layers = net.layers
    assert layers[0] is layers["0"] and layers[-1] is layers["2"] and layers[1:] == [layers["1"], layers["2"]]
    assert list(layers) == ["0", "1", "2"] and len(layers) == 3  # iteration stays over keys
    assert torch.equal(net(x), want)
    assert net.state_dict().keys() == before.keys()  # same parameter names
    assert type(copy.deepcopy(net).layers) is BlockDict


def test_torchtitan_style_llama_is_read_as_its_block_list_with_the_attention_pair() -> None:
    mf = load_model_file(TITAN)
    spec = model_spec(mf)
    assert (spec.blocks_path, spec.num_blocks, spec.blocks_kind) == ("layers", 4, "BlockDict")
    # the complex rotary embedding works within a head: q, k and v stay column-parallel into wo
    assert spec.tp.source == "inferred", spec.tp.detail
    assert dict(spec.tp.styles) == {
        "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
        "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise"}
    assert (spec.num_heads, spec.num_kv_heads) == (4, 2)
    assert spec.supports("tp") and spec.supports("pp")


def test_a_pair_split_across_the_sharded_feature_dim_stays_refused(tmp_path: Path) -> None:
    # view_as_complex over pairs of whole heads' halves (the sharded dim itself) is no local rotation
    body = TITAN.read_text().replace(
        "xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))",
        "xq_ = torch.view_as_complex(xq.float().reshape(xq.shape[0], xq.shape[1], 2, -1).transpose(-1, -2)"
        ".contiguous()).reshape(xq.shape[0], xq.shape[1], -1, xq.shape[-1] // 2)")
    assert body != TITAN.read_text()
    path = tmp_path / "paired_heads.py"
    path.write_text(body)
    spec = model_spec(load_model_file(path))
    assert "attention.wq" not in dict(spec.tp.styles)


@pytest.mark.parametrize("index", [0, 2])
def test_a_pipeline_chunk_of_a_block_dict_runs_the_model_loop(index: int) -> None:
    from autopar.executor.parallel.pipeline_parallel import _ChunkBlockDict

    chunk = _ChunkBlockDict()
    chunk.add_module("inject", nn.Identity())
    chunk.add_module("2", nn.Linear(4, 4))
    chunk.add_module("3", nn.Linear(4, 4))
    assert list(chunk.keys()) == ["inject", "2", "3"]
    assert chunk[index // 2] is chunk[str(2 + index // 2)]  # an integer index is the chunk's i-th block
