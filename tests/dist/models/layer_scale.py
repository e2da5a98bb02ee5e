"""A pre-LN MLP stack whose residual branch is scaled by a learned per-channel vector in a module of
its own (DINOv2's ``Dinov2LayerScale``, CaiT's layer scale): under Megatron sequence parallelism the
scale runs on each tp rank's sequence shard, like a norm, and its gradient is summed over the ranks."""

import torch
import torch.nn.functional as F
from torch import nn

D, V, L, SEQ_LEN = 32, 64, 4, 16


class LayerScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((D,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mlp = Mlp()
        self.scale = LayerScale()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.scale(self.mlp(self.norm(h)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_model():
    return Net()


def example_inputs(micro_batch_size: int):
    return torch.randint(0, V, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].reshape(-1, V).float(), inputs[:, 1:].reshape(-1))
