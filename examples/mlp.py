"""A non-transformer model: a deep residual MLP classifier. No tp_plan: autopar infers fc1 -> fc2 as a
column->row pair from the data flow. CP does not apply (no SEQ_LEN)."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, DEPTH, NUM_CLASSES, IN_FEATURES = 512, 12, 10, 256


class ResidualMLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.ModuleList(ResidualMLPBlock(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


pipeline_blocks = "blocks"


def build_model():
    return ResidualMLP()


def example_inputs(micro_batch_size: int):
    g = torch.Generator().manual_seed(micro_batch_size)
    x = torch.randn(micro_batch_size, IN_FEATURES, generator=g, device="cpu")
    return x


def loss_fn(output, inputs):
    # Synthetic target: the class is a fixed function of the input, so the task is learnable.
    target = (inputs.sum(dim=-1) * 1000).long() % NUM_CLASSES
    return F.cross_entropy(output.float(), target)
