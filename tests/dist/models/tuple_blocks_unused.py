"""A small decoder written the way several Hugging Face models are: each block returns a one-element
tuple ``(hidden,)`` that the model's loop indexes (``layer(h)[0]``), each block reads its input's
three dimensions (``b, s, d = h.shape``), and the root holds a parameter that the training forward
never uses (a ``mask_token``, as DINOv2 carries one for masked-image batches)."""

import torch
import torch.nn.functional as F
from torch import nn

D, V, L, SEQ_LEN = 32, 64, 4, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor]:
        b, s, d = hidden_states.shape  # a 2-d input (batch row 0 of a bare tensor) fails here
        mixed = hidden_states.cumsum(dim=1) / torch.arange(1, s + 1, dtype=hidden_states.dtype, device=hidden_states.device).view(1, s, 1)
        return (hidden_states + self.fc2(F.gelu(self.fc1(self.norm(mixed)))),)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, D))  # read only for masked batches: never here
        self.layers = nn.ModuleList(Block() for _ in range(L))
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(ids)
        if masked is not None:
            h = torch.where(masked.unsqueeze(-1), self.mask_token.to(h.dtype), h)
        for layer in self.layers:
            h = layer(h)[0]
        return self.head(h)


def build_model():
    return Net()


def example_inputs(micro_batch_size: int):
    return torch.randint(0, V, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].reshape(-1, V).float(), inputs[:, 1:].reshape(-1))
