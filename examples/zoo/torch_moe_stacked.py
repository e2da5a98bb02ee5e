"""A plain-torch decoder whose MLP is a mixture of experts written the way grouped-expert code is:
a biased ``nn.Linear`` router, softmax, ``torch.topk``; the experts' weights stacked in one module
as 3-D parameters with per-expert biases (``w_in`` (E, d, f), ``b_in`` (E, f), ``w_out`` (E, f, d),
``b_out`` (E, d)), called as ``experts(x, indices, scores)`` and looping over the experts that got
tokens; and a shared expert (a GELU MLP) every token goes through, added to the routed output.
Causal attention through ``scaled_dot_product_attention``, next-token loss.

Full size: a DeepSeekMoE-16B-like shape (28 layers, hidden 2048, 16 heads, 64 experts of 1408,
top-6, one shared expert of 2816, vocab 102400, 4096 tokens).
"""

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    "tiny": dict(layers=4, hidden=64, heads=4, experts=4, top_k=2, expert_hidden=48, shared_hidden=96,
                 vocab=256, seq=32),
    "full": dict(layers=28, hidden=2048, heads=16, experts=64, top_k=6, expert_hidden=1408, shared_hidden=2816,
                 vocab=102400, seq=4096),
}
SIZE = "tiny"
CFG = SIZES[SIZE]
SEQ_LEN = CFG["seq"]


class StackedExperts(nn.Module):
    def __init__(self, d: int, f: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, d, f) * d ** -0.5)
        self.b_in = nn.Parameter(torch.zeros(num_experts, f))
        self.w_out = nn.Parameter(torch.randn(num_experts, f, d) * f ** -0.5)
        self.b_out = nn.Parameter(torch.zeros(num_experts, d))

    def forward(self, x, indices, scores):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(indices == e)
            if tok.numel() == 0:
                continue
            h = F.gelu(x[tok] @ self.w_in[e] + self.b_in[e])
            out.index_add_(0, tok, (h @ self.w_out[e] + self.b_out[e]) * scores[tok, slot, None])
        return out


class SharedExpertMoE(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.top_k = CFG["top_k"]
        self.router = nn.Linear(d, CFG["experts"], bias=True)
        self.experts = StackedExperts(d, CFG["expert_hidden"], CFG["experts"])
        self.shared_in = nn.Linear(d, CFG["shared_hidden"])
        self.shared_out = nn.Linear(CFG["shared_hidden"], d)

    def forward(self, x):
        b, s, d = x.shape
        x = x.reshape(-1, d)
        scores, indices = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        routed = self.experts(x, indices, scores / scores.sum(-1, keepdim=True))
        return (routed + self.shared_out(F.gelu(self.shared_in(x)))).view(b, s, d)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        d = CFG["hidden"]
        self.heads = CFG["heads"]
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.moe = SharedExpertMoE(d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.moe(self.norm2(x))


class StackedMoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CFG["vocab"], CFG["hidden"])
        self.layers = nn.ModuleList([Block() for _ in range(CFG["layers"])])
        self.norm = nn.LayerNorm(CFG["hidden"])
        self.head = nn.Linear(CFG["hidden"], CFG["vocab"], bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model():
    return StackedMoELM()


def example_inputs(micro_batch_size):
    return torch.randint(0, CFG["vocab"], (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
