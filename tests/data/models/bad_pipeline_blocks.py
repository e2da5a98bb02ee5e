"""Bad model file: pipeline_blocks names an attribute the model does not have."""

import torch
from torch import nn

pipeline_blocks = "decoder.layers"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 8)
