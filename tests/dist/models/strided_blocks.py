"""A ViT-like model whose blocks return a non-contiguous view (the strides of a transposed layout),
as some timm-style blocks do: a pipeline stage boundary must send it all the same."""
import torch
from torch import nn

SEQ_LEN = 16
DIM = 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        y = x + self.fc2(torch.relu(self.fc1(self.norm(x))))
        return y.transpose(0, 1).contiguous().transpose(0, 1)  # same values, strides of a (S, B, D) tensor


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(DIM, 10)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1))


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, SEQ_LEN, 8)


def loss_fn(output, inputs):
    return output.float().pow(2).mean()
