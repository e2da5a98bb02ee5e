"""Tensor parallelism is checked degree by degree (layout.TPDegrees, spec/tp_degree.py): a degree the
shape rules allow is also run, block 0 at one rank's width on meta, and the search, ``estimate`` and
the executor's preflight all ask that one predicate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autopar.layout import TPDegrees

# 64 features a block, split into 16 groups of channels (a fused layout, as CodeGen's qkv in 4 groups
# of whole heads): a rank's slice keeps the groups whole up to tp 4; at tp 8 a rank holds 8 features,
# which 16 groups cannot share. The widths (64) and the absence of heads allow tp 8 by shape alone.
_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

SEQ_LEN = 16
VOCAB = 128
tp_plan = {"fc1": "colwise", "fc2": "rowwise"}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 64)

    def forward(self, x):
        h = self.fc1(x)
        h = h.reshape(*h.shape[:-1], 4, 4, -1).flatten(-3)
        return x + self.fc2(torch.relu(h))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 64)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(64, VOCAB)

    def forward(self, ids):
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randint(0, VOCAB, (micro_batch_size, SEQ_LEN))


def loss_fn(out, ids):
    return F.cross_entropy(out[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
'''


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp_degrees") / "grouped.py"
    path.write_text(_MODEL, encoding="utf-8")
    return path


def test_the_rules_allow_only_divisors_and_refused_degrees_say_why() -> None:
    d = TPDegrees(num_heads=16, num_kv_heads=16, widths=(("attn.qkv", 12288), ("mlp.fc", 4096)),
                  refused=((8, "the block does not run at tp = 8"),))
    assert d.candidates() == (2, 4, 8, 16)
    assert d.reason(1) is None and d.reason(4) is None
    assert d.reason(8) == "the block does not run at tp = 8"
    assert "attention heads" in d.reason(3)
    assert "width 4096 of mlp.fc" in TPDegrees(widths=(("mlp.fc", 4096),)).reason(3)


def test_a_degree_whose_block_fails_on_meta_is_refused_and_smaller_ones_are_not(grouped: Path) -> None:
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    spec = model_spec(load_model_file(grouped))
    assert spec.support_reason("tp") is None
    degrees = spec.tp_degrees
    assert degrees.reason(2) is None and degrees.reason(4) is None
    assert "does not run at tp = 8" in degrees.reason(8) and "\n" not in degrees.reason(8)


def test_search_never_offers_the_refused_degree_and_estimate_refuses_it(grouped: Path) -> None:
    from autopar import api
    from autopar.errors import PlanError

    found = api.plan_search(grouped, 8, "a100-80g", gpus_per_node=8, top=20, global_batch=64, use_cache=False)
    assert found.plans and all(p.parallel.tp != 8 for p in found.plans)
    assert found.graph.tp_allowed(8) == found.graph.tp_degrees.reason(8)
    assert any("tp = 8" in why for why in found.result.rejected)
    best = found.plans[0]
    at_tp8 = dataclasses.replace(best, parallel=dataclasses.replace(best.parallel, dp=1, tp=8, pp=1, cp=1,
                                                                     sequence_parallel=False))
    with pytest.raises(PlanError) as err:
        api.estimation(grouped, at_tp8)
    message = str(err.value)
    assert "parallel.tp = 8 is not possible" in message and "\n" not in message
    # the executor's preflight refuses it for the same reason, before any rank starts
    from autopar.errors import AutoparError
    from autopar.executor.runtime.checks import preflight
    from autopar.modelfile import load_model_file

    with pytest.raises(AutoparError) as refused:
        preflight(at_tp8, load_model_file(grouped))
    assert str(refused.value) == found.graph.tp_allowed(8)
