"""Bad model file: the forward pass needs real data (``.item()``), so it fails on meta."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        if x.sum().item() > 0:  # data-dependent control flow
            x = x * 2
        return x


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 8)
