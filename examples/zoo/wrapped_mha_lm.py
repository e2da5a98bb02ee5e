"""A plain-torch language model wrapped the way training frameworks wrap one: the network sits in an
attribute named ``model`` (``LanguageModel.model.blocks[i]``), and each block uses
``torch.nn.MultiheadAttention`` (a packed ``in_proj_weight`` parameter, not Linear layers) with a causal
mask and a GELU MLP in an ``nn.Sequential``.

Full size: 1.3B-class (24 layers, hidden 2048, 16 heads, vocab 32000, 2048 tokens).
"""

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    "tiny": dict(layers=4, dim=64, heads=4, vocab=256, seq=32),
    "full": dict(layers=24, dim=2048, heads=16, vocab=32000, seq=2048),
}
SIZE = "tiny"
CFG = SIZES[SIZE]
SEQ_LEN = CFG["seq"]


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        s = x.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Backbone(nn.Module):
    def __init__(self, layers, dim, heads, vocab, seq):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class LanguageModel(nn.Module):
    def __init__(self, **cfg):
        super().__init__()
        self.model = Backbone(**cfg)
        self.lm_head = nn.Linear(cfg["dim"], cfg["vocab"], bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def build_model():
    return LanguageModel(**CFG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CFG["vocab"], (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].flatten(0, 1).float(), inputs[:, 1:].flatten())
