"""A model whose forward never returns (a wait on a condition that never comes true): planning
must end with exit 2 and one line once the tracing time limit passes, never hang."""

import torch
from torch import nn

SEQ_LEN = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        ready = False
        while not ready:  # nothing ever sets it
            pass
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def build_model():
    return Model()


def example_inputs(micro_batch_size):
    return torch.randint(0, 32, (micro_batch_size, SEQ_LEN))
