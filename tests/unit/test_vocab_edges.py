"""The vocabulary edges (spec/vocab_edges.py): the token embedding is a module that runs before the
blocks, the output head one that runs after them. A Linear before the blocks as wide as the
vocabulary is neither, whatever its shape says."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.modelfile import load_model_file
from autopar.spec import model_spec

_MODEL = '''
import torch
from torch import nn

SEQ_LEN = 16
VOCAB = 64
HEAD = {head}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.pos = nn.Embedding(SEQ_LEN, 32)
        # registered before the mixing layer, so that order alone would not pick the right one
        self.head = nn.Linear(32, VOCAB) if HEAD else None
        self.mix = nn.Linear(32, VOCAB)  # before the blocks, as wide as the vocabulary
        self.back = nn.Linear(VOCAB, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        x = self.back(torch.relu(self.mix(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(x) if HEAD else x @ self.tok.weight.T


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randint(0, VOCAB, (micro_batch_size, SEQ_LEN))
'''


# tied-matmul-head: logits = h @ tok.weight.T reads the table after the blocks, outside any head module;
# a vocabulary-sharded table would meet a replicated activation there, so it stays whole
@pytest.mark.parametrize(("head", "expected"), [(True, ("tok", "head")), (False, (None, None))],
                         ids=["linear-head", "tied-matmul-head"])
def test_a_linear_before_the_blocks_is_never_the_output_head(tmp_path: Path, head: bool,
                                                             expected: tuple[str, str | None]) -> None:
    path = tmp_path / f"pre_linear_{head}.py"
    path.write_text(_MODEL.format(head=head), encoding="utf-8")
    spec = model_spec(load_model_file(path))
    assert spec.blocks_path == "blocks"
    assert [n for n, _ in spec.probe.prologue][:3] == ["tok", "pos", "mix"]
    assert (spec.vocab_embedding, spec.vocab_head) == expected


def test_without_a_probe_every_module_outside_the_blocks_is_a_candidate() -> None:
    """A chain whose forward was not read keeps the shape rule alone; with a probe, a Linear that ran
    before the blocks is no head and an embedding that ran after them is no token embedding."""
    from torch import nn

    from autopar.spec.blocks import BlockCall, Probe
    from autopar.spec.vocab_edges import vocab_edges

    model = nn.Module()
    model.pre = nn.Linear(8, 50)
    model.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    model.late = nn.Embedding(50, 8)
    assert vocab_edges(model, "blocks", None) == ("late", "pre")
    call = BlockCall(num_args=1, kwargs=(), first_arg_is_tensor=True)
    probe = Probe(prologue=(("pre", "Tensor"),), epilogue=("late",), block_call=call, block_output="Tensor")
    assert vocab_edges(model, "blocks", probe) == (None, None)


def test_the_planners_tp_rank_copy_shards_the_edges_the_executor_shards(tmp_path: Path) -> None:
    """The meta copy the planner traces at tp 2 narrows only the spec's edges (and what is tied to
    them), so a table kept whole by the executor is priced whole."""
    from autopar.spec.tp_shard import shard_for_tp

    path = tmp_path / "pre_linear_matmul_head.py"
    path.write_text(_MODEL.format(head=False), encoding="utf-8")
    mf = load_model_file(path)
    model, spec = mf.build("meta"), model_spec(mf)
    edges = (spec.vocab_embedding, spec.vocab_head)
    rank = shard_for_tp(model, "blocks", {"fc": "colwise"}, 2, edges=edges)
    assert rank.tok.weight.shape == (64, 32) and rank.mix.weight.shape == (64, 32)
    linear_head = tmp_path / "pre_linear_head.py"
    linear_head.write_text(_MODEL.format(head=True), encoding="utf-8")
    mf = load_model_file(linear_head)
    model, spec = mf.build("meta"), model_spec(mf)
    rank = shard_for_tp(model, "blocks", {"fc": "colwise"}, 2, edges=(spec.vocab_embedding, spec.vocab_head))
    assert rank.tok.weight.shape == (32, 32) and rank.head.weight.shape == (32, 32)
    assert rank.mix.weight.shape == (64, 32)  # as wide as the vocabulary, before the blocks: left whole
