"""Which list holds a model's blocks: a list without parameters is none, a list of lists is none (the
chain looks through it to its lists' children), and a list whose blocks the forward does not all call
(alternatives picked per call) gives way to the next candidate."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from autopar.modelfile import load_model_file
from autopar.spec import model_spec
from autopar.spec.blocks import find_block_list

_HEADER = '''
import torch
from torch import nn


def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, 8, 16)


def loss_fn(output, inputs):
    return output.float().pow(2).mean()
'''


def _write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(_HEADER + body)
    return path


def test_a_list_of_parameter_free_modules_or_of_lists_is_no_block_list() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.slots = nn.ModuleList([nn.Identity(), nn.Identity(), nn.Identity()])
            self.stages = nn.ModuleList([nn.ModuleList([nn.Linear(4, 4) for _ in range(2)]) for _ in range(2)])

    net = Net()
    assert find_block_list(net, None) is None
    # a list of identical blocks holding most of what the lists hold (spec/blocks.py: a small one
    # beside larger stages leaves the model a chain, tests/unit/test_block_list_share.py)
    net.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
    assert find_block_list(net, None) == "layers"
    assert find_block_list(net, None, exclude=frozenset({"layers"})) is None


def test_the_chain_of_a_list_of_lists_is_the_inner_lists_children_in_call_order(tmp_path: Path) -> None:
    # Funnel's shape: blocks of layers, the sequence halved between blocks, the inner lists iterated
    path = _write(tmp_path, "funnel_like", '''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleList([nn.Linear(16, 16) for _ in range(2)]) for _ in range(2)])
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i:
                x = x[:, ::2]
            for layer in block:
                x = torch.relu(layer(x))
        return self.head(x)


def build_model():
    return Net()
''')
    spec = model_spec(load_model_file(path))
    assert spec.blocks_kind == "chain"
    assert spec.chain.units == ("blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1")
    assert [s[1] for s in spec.chain.input_shapes] == [8, 8, 4, 4]  # the sequence shrinks inside
    assert spec.support["zero3"] is None


def test_a_list_of_alternatives_the_forward_picks_from_is_passed_over(tmp_path: Path) -> None:
    # each layer picks one adapter of a list by its depth: the adapter list (more parameters than
    # one layer) is found first, but the forward never calls its last adapter, so the layers win
    path = _write(tmp_path, "picked", '''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.adapters = nn.ModuleList([nn.Linear(16, 64) for _ in range(3)])
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.out = nn.Linear(64, 16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(self.adapters[0](x))


def build_model():
    return Net()
''')
    spec = model_spec(load_model_file(path))
    assert spec.blocks_path == "layers" and spec.num_blocks == 3


def test_meta_passes_torchs_own_tensor_assertions() -> None:
    from autopar.spec.meta import tolerant_meta

    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with tolerant_meta():
        n = (ids == 5).sum()
        # LLaVA: torch._check_tensor_all_with(ValueError, n * hidden == features.numel(), msg)
        torch._check_tensor_all_with(ValueError, n * 4 == 64, lambda: "image tokens do not match")


def test_one_layer_applied_at_every_depth_is_a_chain_of_one_unit_pp_refused_by_name(tmp_path: Path) -> None:
    # ALBERT's sharing: one group of layers in a list, called at each of 4 depths
    path = _write(tmp_path, "shared", '''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.groups = nn.ModuleList([nn.Linear(16, 16)])
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        for _ in range(4):
            x = torch.relu(self.groups[0](x))
        return self.head(x)


def build_model():
    return Net()
''')
    spec = model_spec(load_model_file(path))
    assert spec.blocks_kind == "chain" and spec.chain.units == ("groups.0",) and spec.num_blocks == 1
    assert "more than once (groups.0: 4 calls, one set of weights shared across depths)" in spec.support["pp"]
    assert spec.support["zero3"] is None and spec.support["cp"] == "not a sequence model (no SEQ_LEN)"


def test_a_unit_the_forward_skips_stays_in_the_chain_pp_refused_and_no_tp_plan_needed(tmp_path: Path) -> None:
    # Mllama's text batch: the cross-attention layers in the one list are skipped without image features
    path = _write(tmp_path, "skipping", '''
class Cross(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 16)

    def forward(self, x, image=None):
        return x if image is None else x + self.gate(image)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, image=None):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Mlp(), Mlp(), Cross(), Mlp()])

    def forward(self, x, image=None):
        for layer in self.layers:
            if isinstance(layer, Cross) and image is None:
                continue
            x = layer(x, image=image)
        return x


def build_model():
    return Net()
''')
    spec = model_spec(load_model_file(path))
    assert spec.chain.units == ("layers.0", "layers.1", "layers.2", "layers.3") and spec.chain.skipped == (2,)
    assert spec.support["pp"] == ("the forward skips a unit that holds parameters (layers.2); a stage boundary "
                                  "at it would never be reached")
    assert spec.support["tp"] is None and spec.support["zero3"] is None
