"""A GPT model file as a user writes it, declaring nothing for autopar: no ``tp_plan`` line, no
``_tp_plan`` on the model, no ``pipeline_blocks``. autopar finds the block list and infers the tensor
parallel pairs (qkv -> proj, fc1 -> fc2) from the data flow of block 0 (docs/models.md "Tensor
parallelism without a tp_plan").

The architecture is the GPT-3-style model of Megatron-LM that Korthikanti et al. 2022 (arXiv:2205.05198)
trained: learned absolute positions, pre-LayerNorm blocks, explicit attention (QK^T, scaled causal
softmax, attention dropout, @V; Megatron's fused scale-mask-softmax, not flash attention), dropout 0.1
after attention and after the MLP, a GELU MLP of width 4h, a final LayerNorm and an output head tied
to the token embedding, vocabulary 51,200, 2,048 tokens. ``SIZES`` holds the paper's Table 3 models
(22B, 175B, 530B, 1T); ``SIZE`` picks one (autopar.reference.plain_gpt_path writes a copy per size).
The modules follow Megatron-LM's own layout (ParallelAttention with its ``CoreAttention`` -- the
part that selective recompute re-runs -- and ParallelMLP), written with plain ``nn.Linear`` layers;
the attention's head split uses ``-1`` heads (the width of the projection decides), as Hugging Face
models write it.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    "tiny": dict(layers=2, hidden=64, heads=4, vocab=256, seq=32),
    "22B": dict(layers=48, hidden=6144, heads=64, vocab=51200, seq=2048),
    "175B": dict(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048),
    "530B": dict(layers=105, hidden=20480, heads=128, vocab=51200, seq=2048),
    "1T": dict(layers=128, hidden=25600, heads=160, vocab=51200, seq=2048),
}
SIZE = "tiny"
CFG = SIZES[SIZE]
SEQ_LEN = CFG["seq"]
DROPOUT = 0.1


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d) + causal mask) -> dropout -> @V on (b, heads, s, d)."""

    def __init__(self, head_dim):
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, q, k, v):
        s = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        mask = torch.full((s, s), float("-inf"), dtype=scores.dtype, device=q.device).triu(1)
        return torch.matmul(self.dropout(torch.softmax(scores + mask, dim=-1)), v)


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.core_attention = CoreAttention(self.head_dim)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = self.core_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads)
        self.drop1 = nn.Dropout(DROPOUT)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)
        self.drop2 = nn.Dropout(DROPOUT)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, layers, hidden, heads, vocab, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model():
    return GPT(**CFG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CFG["vocab"], (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].reshape(-1, output.size(-1)).float(), inputs[:, 1:].reshape(-1))
