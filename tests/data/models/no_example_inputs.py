"""Bad model file: defines build_model but no example_inputs."""

from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(4, 4))
