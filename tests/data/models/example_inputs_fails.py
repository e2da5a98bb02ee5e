"""Bad model file: example_inputs raises."""

from torch import nn


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
    raise FileNotFoundError("dataset shard /data/train-000.bin")
