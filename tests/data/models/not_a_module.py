"""Bad model file: build_model returns something that is not an nn.Module."""

import torch


def build_model():
    return {"weights": [1, 2, 3]}


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 4)
