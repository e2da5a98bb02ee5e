"""A plain-torch decoder whose MLP is a top-k mixture of experts, written the way hand-written MoE
code is: ``nn.Linear`` router, softmax, ``torch.topk``, an ``nn.ModuleList`` of SwiGLU experts each
called on the rows ``torch.where(idx == e)`` picks (skipped when no token chose it), ``index_add_``
back. Causal attention through ``scaled_dot_product_attention``, next-token loss.

Full size: OLMoE-1B-7B's shape (16 layers, hidden 2048, 16 heads, 64 experts of 1024, top-8,
vocab 50304, 4096 tokens).
"""

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    "tiny": dict(layers=4, hidden=64, heads=4, experts=4, top_k=2, expert_hidden=96, vocab=256, seq=32),
    "full": dict(layers=16, hidden=2048, heads=16, experts=64, top_k=8, expert_hidden=1024, vocab=50304, seq=4096),
}
SIZE = "tiny"
CFG = SIZES[SIZE]
SEQ_LEN = CFG["seq"]


class Expert(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, f, bias=False)
        self.up = nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class TopKMoE(nn.Module):
    def __init__(self, d: int, f: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(d, f) for _ in range(num_experts)])

    def forward(self, x):
        b, s, d = x.shape
        x = x.reshape(-1, d)
        weights, idx = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if not mask.any():
                continue
            tok, slot = torch.where(mask)
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return out.view(b, s, d)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        d = CFG["hidden"]
        self.heads = CFG["heads"]
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.moe = TopKMoE(d, CFG["expert_hidden"], CFG["experts"], CFG["top_k"])

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.moe(self.norm2(x))


class MoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CFG["vocab"], CFG["hidden"])
        self.layers = nn.ModuleList([Block() for _ in range(CFG["layers"])])
        self.norm = nn.RMSNorm(CFG["hidden"])
        self.head = nn.Linear(CFG["hidden"], CFG["vocab"], bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model():
    return MoELM()


def example_inputs(micro_batch_size):
    return torch.randint(0, CFG["vocab"], (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
