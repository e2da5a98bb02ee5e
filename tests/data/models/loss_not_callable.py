"""Bad model file: loss_fn is not a function."""

import torch
from torch import nn

loss_fn = "cross_entropy"


def build_model():
    return nn.Linear(4, 4)


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 4)
