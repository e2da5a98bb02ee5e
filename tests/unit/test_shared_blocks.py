"""Blocks that share a module (Zamba2's attention block tied into every hybrid layer): ZeRO groups the
shared modules once, the chain measurement keeps unrun units in their places for a forward that looks
its layers up by position (and runs every unit for one that counts their outputs), and a pipeline
stage hands back dense gradients of what it received."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from autopar.executor.parallel.data_parallel import shared_module_groups
from autopar.executor.parallel.pipeline_parallel import StageModule, StepIO
from autopar.graph import build_graph
from autopar.modelfile import load_model_file


class _Hybrid(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared, self.own = shared, nn.Linear(8, 8)


def test_modules_tied_into_several_blocks_form_one_group_per_parameter_set() -> None:
    attn = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    twin = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for a, b in zip(attn, twin):  # tied as transformers ties them: other modules, the same Parameters
        b.weight, b.bias = a.weight, a.bias
    blocks = [nn.Linear(8, 8), _Hybrid(attn), nn.Linear(8, 8), _Hybrid(twin)]
    groups = shared_module_groups(blocks)
    assert len(groups) == 1 and groups[0][0] is attn and groups[0][1] is twin
    assert shared_module_groups([nn.Linear(8, 8), nn.Linear(8, 8)]) == []


def test_a_forward_that_indexes_its_layers_by_position_is_measured_with_unrun_units_in_place(tmp_path: Path) -> None:
    # six layers of two kinds; the forward hands each layer its position, and the second kind looks
    # its own slot up by it (Zamba2's layer_dic): a renumbered cut list would fail that lookup
    path = tmp_path / "by_position.py"
    path.write_text('''
import torch
from torch import nn

KINDS = "aabaab"


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, idx):
        return torch.relu(self.fc(x))


class Slotted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.slot = {i: n for n, i in enumerate(i for i, k in enumerate(KINDS) if k == "b")}
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x, idx):
        return self.fc(x) * self.scale[self.slot[idx]]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Plain() if k == "a" else Slotted() for k in KINDS])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x, i)
        return x


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, 16)


def loss_fn(output, inputs):
    return output.pow(2).mean()
''')
    graph = build_graph(load_model_file(path))
    assert graph.num_blocks == 6 and [u.region for u in graph.chain] == ["unit.0"] * 2 + ["unit.2"] + ["unit.0"] * 2 + ["unit.2"]


def test_a_stage_hands_back_dense_gradients_of_its_received_tensors() -> None:
    stage = StageModule(nn.Linear(4, 4), is_first=False, is_last=True, io=StepIO(torch.zeros(1, 4)))
    x = torch.randn(1, 3, 4, requires_grad=True)
    stage(x, **stage.io.step_kwargs(torch.zeros(1, 4)))
    # the next op reads the received tensor through a concatenation: its gradient is a strided slice
    y = torch.cat([x, torch.randn(1, 3, 4)], dim=-1)
    (grad,) = torch.autograd.grad((y * torch.randn(1, 3, 8)).sum(), x)
    assert grad.is_contiguous()


def test_a_forward_that_counts_its_units_outputs_is_measured_with_every_unit(tmp_path: Path) -> None:
    # Funnel's decoder adds the hidden state after block_sizes[0] layers: a cut chain has fewer
    path = tmp_path / "counted.py"
    path.write_text('''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleList([nn.Linear(16, 16) for _ in range(3)]),
                                     nn.ModuleList([nn.Linear(16, 16)])])

    def forward(self, x):
        states = [x]
        for block in self.blocks:
            for layer in block:
                x = torch.relu(layer(x))
                states.append(x)
        return x + states[3]


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, 16)


def loss_fn(output, inputs):
    return output.pow(2).mean()
''')
    graph = build_graph(load_model_file(path))
    assert graph.num_blocks == 4 and {u.region for u in graph.chain} == {"unit.0"}
