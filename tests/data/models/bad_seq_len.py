"""Bad model file: SEQ_LEN is not a positive integer."""

import torch
from torch import nn

SEQ_LEN = "2k"


def build_model():
    return nn.Linear(4, 4)


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 4)
