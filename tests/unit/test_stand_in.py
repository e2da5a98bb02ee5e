"""Pipeline markers answer the attribute reads model code makes on the module whose place they take
(executor/parallel/stand_in.py): a block's settings, a child's presence, parameter shapes; calling a child
that lives on another stage is an error naming it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autopar.executor.parallel.pipeline_parallel import _Exit, _Skip, _ZeroStub
from autopar.executor.parallel.stand_in import AbsentModule
from autopar.spec.pipeline_probe import Template


class Stage(nn.Module):
    def __init__(self, downsample: bool) -> None:
        super().__init__()
        self.attention_type = "sliding_attention"
        self.layer_idx = 3
        self.proj = nn.Linear(4, 8)
        self.downsample = nn.Linear(8, 4) if downsample else None


def test_a_marker_answers_what_the_model_reads_off_the_block():
    block = Stage(downsample=True)
    marker = _Exit("hidden_states").stand_for(block, "encoder.layers.2")
    assert marker.attention_type == "sliding_attention" and marker.layer_idx == 3
    assert marker.first_param == "hidden_states"  # the marker's own attributes come first
    assert marker.downsample is not None and isinstance(marker.downsample, AbsentModule)
    assert marker.proj.weight.shape == (8, 4) and marker.proj.weight.device.type == "meta"
    assert marker.downsample.out_features == 4
    assert list(marker.parameters()) == []  # nothing registered: nothing to shard, move or train


def test_an_absent_child_is_none_where_the_original_is():
    marker = _Skip(Template.of(torch.zeros(1)), None).stand_for(Stage(downsample=False), "encoder.layers.0")
    assert marker.downsample is None


def test_calling_a_module_of_another_stage_names_it():
    marker = _ZeroStub(Template.of(torch.zeros(1)), torch.device("cpu")).stand_for(Stage(True), "encoder.layers.1")
    with pytest.raises(RuntimeError, match=r"encoder\.layers\.1\.downsample \(Linear\)"):
        marker.downsample(torch.zeros(2, 8))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        marker.nothing_here  # noqa: B018 - the read is the test


def test_a_marker_survives_the_chunk_copy():
    marker = _Exit(None).stand_for(Stage(True), "layers.0")
    copied = copy.deepcopy(nn.ModuleList([marker]))[0]
    assert copied.attention_type == "sliding_attention" and copied.downsample.in_features == 8
