"""A model whose forward reads a tensor value (a data-dependent branch): it plans (meta reads get a
default) and runs, but a rehearsal on fake tensors cannot run it."""

import torch
from torch import nn

SEQ_LEN = 16
pipeline_blocks = "layers"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        if x.abs().max().item() > 1e6:  # a value read
            x = x / 2
        return x + self.fc(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build_model():
    return Model()


def example_inputs(micro_batch_size):
    return torch.randint(0, 64, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return nn.functional.cross_entropy(output.flatten(0, 1), inputs.flatten())
