"""Test fixture: a plain-torch decoder whose layers differ -- a dense first layer, then three
mixture-of-experts layers whose experts are an ``nn.ModuleList`` picked by the layer's own top-2
routing loop -- so its blocks are a layer chain (DeepSeek's structure) and expert parallelism
shards the experts of the units that hold them (the MoE module's own code replayed around the
exchange: executor/parallel/expert_parallel.py)."""

import torch
import torch.nn.functional as F
from torch import nn

SEQ_LEN, VOCAB, H, E, K = 16, 64, 32, 4, 2


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        w, idx = torch.topk(self.router(flat).softmax(-1), K, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, expert(flat[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


class Layer(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.ffn = MoE() if moe else Expert()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList([Layer(False), Layer(True), Layer(True), Layer(True)])
        self.out = nn.Linear(H, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_model() -> nn.Module:
    return Model()


def example_inputs(micro_batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (micro_batch_size, SEQ_LEN))


def loss_fn(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), inputs.reshape(-1))
