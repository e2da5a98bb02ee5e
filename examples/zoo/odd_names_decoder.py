"""A decoder-only GQA/SwiGLU transformer written with its own module names, as research code often is:
``trunk.cells[i].mix.{query,keyval,out}`` (keys and values from one fused projection) and
``trunk.cells[i].ffw.{gate,up,down}``, RoPE computed inline, ``torch.nn.RMSNorm``, an untied
``unembed``. Nothing here is named like Megatron or Hugging Face.

Full size: 7B-class (32 cells, width 4096, 32 query heads / 8 key-value heads, FFW 14336, vocab 32000,
4096 tokens).
"""

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    "tiny": dict(cells=4, width=64, heads=4, kv_heads=2, ffw=128, vocab=256, seq=32),
    "full": dict(cells=32, width=4096, heads=32, kv_heads=8, ffw=14336, vocab=32000, seq=4096),
}
SIZE = "tiny"
CFG = SIZES[SIZE]
SEQ_LEN = CFG["seq"]


def rotate(x, base=10000.0):
    """RoPE on (batch, heads, seq, dim), the half-split variant."""
    d, s = x.shape[-1], x.shape[-2]
    freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.arange(s, device=x.device, dtype=torch.float32)[:, None] * freq[None, :]
    cos, sin = ang.cos().repeat(1, 2).to(x.dtype), ang.sin().repeat(1, 2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Mix(nn.Module):
    def __init__(self, width, heads, kv_heads):
        super().__init__()
        self.head_dim = width // heads
        self.query = nn.Linear(width, heads * self.head_dim, bias=False)
        self.keyval = nn.Linear(width, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.query(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        kv = self.keyval(x).view(b, s, -1, 2, self.head_dim)
        k, v = kv[..., 0, :].transpose(1, 2), kv[..., 1, :].transpose(1, 2)
        q, k = rotate(q), rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Ffw(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Cell(nn.Module):
    def __init__(self, width, heads, kv_heads, ffw):
        super().__init__()
        self.pre_mix = nn.RMSNorm(width, eps=1e-6)
        self.mix = Mix(width, heads, kv_heads)
        self.pre_ffw = nn.RMSNorm(width, eps=1e-6)
        self.ffw = Ffw(width, ffw)

    def forward(self, x):
        x = x + self.mix(self.pre_mix(x))
        return x + self.ffw(self.pre_ffw(x))


class Trunk(nn.Module):
    def __init__(self, cells, width, heads, kv_heads, ffw):
        super().__init__()
        self.cells = nn.ModuleList(Cell(width, heads, kv_heads, ffw) for _ in range(cells))

    def forward(self, x):
        for cell in self.cells:
            x = cell(x)
        return x


class Decoder(nn.Module):
    def __init__(self, cells, width, heads, kv_heads, ffw, vocab, seq):
        super().__init__()
        self.lookup = nn.Embedding(vocab, width)
        self.trunk = Trunk(cells, width, heads, kv_heads, ffw)
        self.final = nn.RMSNorm(width, eps=1e-6)
        self.unembed = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        return self.unembed(self.final(self.trunk(self.lookup(tokens))))


def build_model():
    return Decoder(**CFG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CFG["vocab"], (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].flatten(0, 1).float(), inputs[:, 1:].flatten())
