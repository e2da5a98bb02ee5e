"""A pipeline stand-in runs the hooks put on the module it replaces (executor/parallel/stand_in.py):
transformers 5 records hidden states through forward hooks on every module of a class, installed at
the model's first forward (Segformer's decode head reads every stage's map; on the last pipeline
stage the earlier stages are stand-ins). It stays a marker for code that finds modules by class."""

from __future__ import annotations

import copy

import torch
from torch import nn

from autopar.executor.parallel.stand_in import StandIn


class Stage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Carried(StandIn):
    """Returns a value computed elsewhere, as the pipeline's carried stand-in does."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value

    def forward(self, *args: object) -> torch.Tensor:
        return self.value


def test_the_hooks_on_the_original_fire_on_its_stand_in() -> None:
    stage, recorded = Stage(4), []
    stage.register_forward_hook(lambda m, a, out: recorded.append(out))
    value = torch.ones(2, 4)
    stand_in = Carried(value).stand_for(stage, "stages.0")
    stand_in(torch.zeros(2, 4))
    assert len(recorded) == 1 and recorded[0] is value


def test_it_stays_a_marker_for_code_that_finds_modules_by_class() -> None:
    stand_in = Carried(torch.ones(1)).stand_for(Stage(4), "stages.0")
    assert not isinstance(stand_in, Stage) and isinstance(stand_in, StandIn)
    assert type(copy.deepcopy(stand_in)) is Carried
