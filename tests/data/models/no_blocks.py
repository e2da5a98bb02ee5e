"""Bad model file: nothing to cut into pipeline stages (no ModuleList of repeated blocks)."""

import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 8)
