"""A residual MLP with 0-d parameters: a learnable residual gate in every block (ReZero-style) and a
learnable logit temperature on the root. FSDP2 cannot shard a 0-d tensor; ZeRO must still run."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, DEPTH, NUM_CLASSES, IN_FEATURES = 32, 4, 10, 16


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.gate = nn.Parameter(torch.tensor(0.5))  # 0-d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.fc2(F.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, NUM_CLASSES)
        self.temperature = nn.Parameter(torch.tensor(1.0))  # 0-d, on the root

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) / self.temperature


def build_model():
    return Net()


def example_inputs(micro_batch_size: int):
    g = torch.Generator().manual_seed(micro_batch_size)
    return torch.randn(micro_batch_size, IN_FEATURES, generator=g)


def loss_fn(output, inputs):
    target = (inputs.sum(dim=-1) * 1000).long() % NUM_CLASSES
    return F.cross_entropy(output.float(), target)
