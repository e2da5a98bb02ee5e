"""A decoder whose projections are fused and split with ``chunk`` (q, k, v from one Linear; gate and
up from one Linear), with each column layer in a different module from its row layer (as BERT
splits them): the executor must permute by the fused counts the data flow showed (3 and 2), not by
a width ratio (the MLP's 8h-wide gate_up over an h-wide attention output would read as 8).
No tp_plan: TP is inferred."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, FFW, VOCAB, LAYERS = 32, 4, 128, 64, 2
SEQ_LEN = 16


class In(nn.Module):
    def __init__(self, width_in, width_out):
        super().__init__()
        self.proj = nn.Linear(width_in, width_out)


class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = In(WIDTH, 3 * WIDTH)
        self.mixed = In(WIDTH, WIDTH)
        self.expand = In(WIDTH, 2 * FFW)
        self.contract = In(FFW, WIDTH)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, WIDTH // HEADS).transpose(1, 2) for t in self.qkv.proj(self.n1(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.mixed.proj(y.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.expand.proj(self.n2(x)).chunk(2, dim=-1)
        return x + self.contract.proj(F.silu(gate) * up)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.cells = nn.ModuleList(Cell() for _ in range(LAYERS))
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for c in self.cells:
            h = c(h)
        return self.out(h)


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return (torch.arange(micro_batch_size * SEQ_LEN) * 7 % VOCAB).view(micro_batch_size, SEQ_LEN)


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].flatten(0, 1).float(), inputs[:, 1:].flatten())
