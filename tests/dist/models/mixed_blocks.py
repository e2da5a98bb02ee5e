"""Test fixture: a plain-torch decoder whose one ``nn.ModuleList`` holds blocks of two kinds -- two
dense blocks, then two mixture-of-experts blocks (grouped expert weights, top-2 of 4, narrower
than the dense MLP) -- as DeepSeek-V2/V3 keep theirs. Every block reads a causal mask and a
position table the forward computes beside the hidden state (``mask=``, ``pos=``), so a pipeline
that carries one activation between stages cannot cut it; the block-list pipeline can."""

import torch
from torch import nn

VOCAB, DIM, HEADS, SEQ_LEN = 64, 32, 4, 16
KINDS = ("dense", "dense", "moe", "moe")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / (DIM // HEADS) ** 0.5 + mask
        return self.out((att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, DIM))


class DenseMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-2 of 4 experts with grouped weights; every expert computed, the unrouted weighted 0."""

    def __init__(self, experts: int = 4, width: int = DIM) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, DIM, width) * DIM ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, width, DIM) * width ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        top, idx = gates.topk(2, dim=-1)
        weights = torch.zeros_like(gates).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        hidden = torch.nn.functional.silu(torch.einsum("bsd,edf->bsef", x, self.w_in))
        return torch.einsum("bsef,efd,bse->bsd", hidden, self.w_out, weights)


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.mlp = DenseMLP() if kind == "dense" else MoE()

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x + pos), mask)
        return x + self.mlp(self.norm2(x))


class MixedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(k) for k in KINDS)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        mask = torch.full((s, s), float("-inf"), device=ids.device).triu(1)
        steps = torch.arange(s, device=ids.device, dtype=torch.float32)[:, None]
        pos = torch.sin(steps / (10.0 ** (torch.arange(DIM, device=ids.device) / DIM)))
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, mask=mask, pos=pos)
        return self.head(self.norm(h))


def build_model():
    return MixedLM()


def example_inputs(micro_batch_size):
    return torch.randint(0, VOCAB, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return nn.functional.cross_entropy(output[:, :-1].reshape(-1, VOCAB), inputs[:, 1:].reshape(-1))
