"""Plain-torch Llama written torchtitan's way: blocks in an ``nn.ModuleDict`` keyed by layer number,
a complex rotary table (``freqs_cis``) precomputed as a non-persistent buffer and passed to every
block, RMSNorm, SwiGLU (w1/w2/w3), GQA through ``repeat_interleave``; the model returns logits.

Full size: Llama 3 8B (32 layers, dim 4096, 32 heads / 8 KV heads, MLP 14336, vocab 128256, 8192 tokens).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    "tiny": dict(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=256, seq=32),
    "full": dict(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256, seq=8192),
}
SIZE = "tiny"
CFG = SIZES[SIZE]
SEQ_LEN = CFG["seq"]


def precompute_freqs_cis(dim, end, theta=500000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        rep = xq.shape[2] // xk.shape[2]
        xk, xv = xk.repeat_interleave(rep, dim=2), xv.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, ffn):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, ffn)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, n_layers, dim, n_heads, n_kv_heads, ffn, vocab, seq):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, seq * 2), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, n_kv_heads, ffn) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def build_model():
    return Transformer(**CFG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CFG["vocab"], (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].flatten(0, 1).float(), inputs[:, 1:].flatten())
