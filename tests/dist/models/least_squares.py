"""Least squares with known gradient noise, as a model autopar can split: a linear network (stem,
blocks of fc1 -> fc2 with a residual, head; no nonlinearity, so the whole map is linear in the input)
fitting y = x . w_true + noise. Inputs are one tensor, features then the target (its last column);
``dataset`` draws a fresh global batch per (seed, step). Used by the gradient noise scale and
AdaScale tests: the noise (NOISE_STD) keeps the gradient noise scale finite at the optimum."""

import torch
from torch import nn

IN_FEATURES, WIDTH, DEPTH, NOISE_STD = 8, 16, 2, 1.0
tp_plan = {"fc1": "colwise", "fc2": "rowwise"}
pipeline_blocks = "blocks"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.5 * self.fc2(self.fc1(x))


class LinearNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        h = self.stem(inputs[:, :IN_FEATURES])
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model():
    return LinearNet()


def _draw(n: int, g: torch.Generator) -> torch.Tensor:
    w_true = torch.linspace(-1.0, 1.0, IN_FEATURES)
    x = torch.randn(n, IN_FEATURES, generator=g)
    y = x @ w_true + NOISE_STD * torch.randn(n, generator=g)
    return torch.cat([x, y[:, None]], dim=1)


def example_inputs(micro_batch_size: int):
    return _draw(micro_batch_size, torch.Generator().manual_seed(micro_batch_size))


def dataset(global_batch_size: int, step: int, seed: int):
    return _draw(global_batch_size, torch.Generator().manual_seed(seed * 1_000_003 + step))


def loss_fn(output, inputs):
    return 0.5 * (output[:, 0].float() - inputs[:, IN_FEATURES]).square().mean()
