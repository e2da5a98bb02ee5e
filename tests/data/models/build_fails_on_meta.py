"""Bad model file: build_model reads a tensor's value, which a meta tensor does not have."""

import torch
from torch import nn


def build_model():
    width = int(torch.tensor(16).item())  # data-dependent construction: impossible on meta
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(2)])


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 16)
