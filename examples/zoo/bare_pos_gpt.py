"""A nanoGPT-style decoder whose learned positions are a bare ``nn.Parameter`` (not an ``nn.Embedding``)
added to the token embeddings, blocks in ``self.h``, fused ``c_attn``, causal SDPA, a head tied to the
token embedding.

Full size: GPT-2 large shape (36 layers, hidden 1280, 20 heads, vocab 50304, 1024 tokens).
"""

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    "tiny": dict(layers=4, dim=64, heads=4, vocab=256, seq=32),
    "full": dict(layers=36, dim=1280, heads=20, vocab=50304, seq=1024),
}
SIZE = "tiny"
CFG = SIZES[SIZE]
SEQ_LEN = CFG["seq"]


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, layers, dim, heads, vocab, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Parameter(torch.zeros(1, seq, dim))
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe[:, : idx.shape[1]]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model():
    return TinyGPT(**CFG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CFG["vocab"], (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].reshape(-1, output.size(-1)).float(), inputs[:, 1:].reshape(-1))
