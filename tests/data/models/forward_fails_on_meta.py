"""Bad model file: the forward pass copies its activations to the CPU, which meta tensors cannot do.

(Value reads such as ``.item()`` are answered on meta -- autopar.spec.meta -- so they no longer fail.)"""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        host = x.detach().to("cpu")  # needs the values
        return x * host.abs().max()


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 8)
