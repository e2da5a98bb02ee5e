"""Test fixture: a plain-torch decoder whose mixture of experts calls its stacked experts the way
JetMoE and ScatterMoE-style code does -- with the (token, slot) rows already sorted by expert and
the rows per expert -- but under other names and conventions: the counts an integer tensor
(``bincount``) passed by keyword beside the rows, read on the host inside the stack; a per-expert
bias; the gates applied and the rows scattered back by the MoE module's own code. Expert
parallelism finds it by that call (spec/moe.py's grouped call) and sends each stack's grouped rows
to their experts (executor/parallel/expert_grouped.py)."""

import torch
import torch.nn.functional as F
from torch import nn

SEQ_LEN, VOCAB, H, FF, E, K, L = 16, 64, 32, 48, 4, 2, 4


class GroupedLinear(nn.Module):
    """E affine maps, applied to rows grouped by expert (``sizes[e]`` rows for expert e in turn)."""

    def __init__(self, n: int, d_in: int, d_out: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, d_in, d_out) / d_in ** 0.5)
        self.b = nn.Parameter(torch.zeros(n, d_out))
        self.n_experts = n

    def forward(self, *, grouped: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        chunks = grouped.split(sizes.tolist())
        return torch.cat([chunks[e] @ self.w[e] + self.b[e] for e in range(self.n_experts)])


class SortedMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w_in = GroupedLinear(E, H, FF)
        self.w_out = GroupedLinear(E, FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs, idx = torch.topk(self.gate(flat).softmax(-1), K, dim=-1)
        order = idx.flatten().argsort(stable=True)
        sizes = torch.bincount(idx.flatten(), minlength=E)
        token = order // K
        h = F.gelu(self.w_in(grouped=flat[token], sizes=sizes))
        y = self.w_out(grouped=h, sizes=sizes) * probs.flatten()[order, None]
        return torch.zeros_like(flat).index_add(0, token, y).reshape(x.shape)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.mix = nn.Linear(H, H)
        self.moe = SortedMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.moe(self.norm2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(Layer() for _ in range(L))
        self.out = nn.Linear(H, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_model() -> nn.Module:
    return Model()


def example_inputs(micro_batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (micro_batch_size, SEQ_LEN))


def loss_fn(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), inputs.reshape(-1))
