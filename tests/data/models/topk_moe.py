"""A plain-torch decoder whose MLP is a top-k mixture of experts, routed the way most hand-written
MoE code routes: ``torch.topk`` over router scores, then per expert ``torch.where(idx == e)`` (a
data-dependent shape) and an ``if not mask.any()`` check (a value read), ``index_add_`` back.

Sizes (module constants, which tests/unit/test_moe.py rewrites in copies): D model width, F_EXPERT
expert width, E experts, K experts per token, H heads, L blocks, V vocabulary, SEQ_LEN tokens.
"""

import torch
import torch.nn.functional as F
from torch import nn

D, F_EXPERT, E, K, H, L, V = 64, 128, 4, 2, 4, 2, 256
SEQ_LEN = 32
DENSE = False  # True: a dense MLP of width K x F_EXPERT instead (the same FLOPs per token, no router)
ROUTING = "where"  # "where": per expert torch.where(idx == e); "sorted": tokens sorted by expert, counts .tolist();
# "argmax": top-1 (Switch-style) scores.argmax(-1), then as "where" (needs K = 1)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, F_EXPERT, bias=False)
        self.down = nn.Linear(F_EXPERT, D, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class DenseMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, K * F_EXPERT, bias=False)
        self.down = nn.Linear(K * F_EXPERT, D, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class TopKMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(E)])

    def forward(self, x):
        b, s, d = x.shape
        x = x.reshape(-1, d)
        if ROUTING == "argmax":
            probs = self.router(x).softmax(-1)
            idx = probs.argmax(-1, keepdim=True)
            weights = probs.gather(-1, idx)
        else:
            weights, idx = torch.topk(self.router(x).softmax(-1), K, dim=-1)
        if ROUTING == "sorted":
            return self._sorted(x, weights, idx).view(b, s, d)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if not mask.any():
                continue
            tok, slot = torch.where(mask)
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return out.view(b, s, d)

    def _sorted(self, x, weights, idx):
        """DeepSeek-style: (token, slot) pairs sorted by expert, sliced by per-expert counts on the host."""
        order = idx.flatten().argsort()
        counts = torch.bincount(idx.flatten(), minlength=E).cpu().tolist()
        rows = x[order // K]
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            outs.append(self.experts[e](rows[start:start + n]))
            start += n
        y = torch.cat(outs) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, order // K, y)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.norm2 = nn.LayerNorm(D)
        self.moe = DenseMLP() if DENSE else TopKMoE()

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, D))
        return x + self.moe(self.norm2(x))


class TopKMoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build_model():
    return TopKMoELM()


def example_inputs(micro_batch_size):
    return torch.randint(0, V, (micro_batch_size, SEQ_LEN))
