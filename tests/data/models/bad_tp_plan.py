"""Bad model file: tp_plan names a style autopar does not know."""

import torch
from torch import nn

tp_plan = {"mlp.fc1": "diagonal"}


def build_model():
    return nn.Linear(4, 4)


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 4)
