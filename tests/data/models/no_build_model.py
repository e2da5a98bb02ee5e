"""Bad model file: defines example_inputs but no build_model."""

import torch


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 4)
