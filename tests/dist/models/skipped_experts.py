"""A top-1 mixture of experts that runs only the experts its tokens chose (HF Switch Transformers'
loop over ``mask.sum(...).nonzero()``): 16 experts and 8 tokens per sample, so each rank's
micro-batch leaves experts without a gradient that another rank's uses."""

import torch
import torch.nn.functional as F
from torch import nn

D, V, E, L, SEQ_LEN = 16, 64, 16, 2, 8


class SkippingMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D)
        probs = self.router(flat).softmax(dim=-1)
        mask = F.one_hot(probs.argmax(dim=-1), num_classes=E)  # (tokens, E)
        out = torch.zeros_like(flat)
        for idx in torch.greater(mask.sum(dim=0), 0).nonzero():
            rows = torch.where(mask[:, idx[0]])[0]
            out.index_add_(0, rows, self.experts[idx[0]](flat[rows]) * probs[rows, idx[0], None])
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.moe = SkippingMoE()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(self.norm(h))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model():
    return Net()


def example_inputs(micro_batch_size: int):
    return torch.randint(0, V, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].reshape(-1, V).float(), inputs[:, 1:].reshape(-1))
