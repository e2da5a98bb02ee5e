"""Megatron GPT exactly as benchmarked in the Megatron-LM papers (docs/design.md §3, a contract).

Learned absolute positions, pre-LayerNorm blocks, explicit attention (QK^T, scaled causal softmax,
attention dropout, @V), dropout after attention and after the MLP, GELU MLP of width 4h, final
LayerNorm and an output head tied to the token embedding. ``fused_attention=True`` swaps the
explicit attention core for ``scaled_dot_product_attention`` (flash-style: no s^2 activations).

Heads are recovered from the projection width at run time (``view(b, s, -1, head_dim)``), so a block
whose Linear layers were sharded for tensor parallelism runs unchanged on its local heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    dropout: float = 0.1
    fused_attention: bool = False
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"GPTConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("GPTConfig.dropout must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d) + causal mask) -> dropout -> @V, on (b, heads, s, d) tensors."""

    def __init__(self, head_dim: int, dropout: float, fused: bool) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)
        self.dropout = dropout
        self.fused = fused

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.fused:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        s_q, s_k = q.shape[-2], k.shape[-2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        # An additive causal bias: unlike masked_fill it keeps nothing for backward, as Megatron's
        # fused scale-mask-softmax kernel keeps no mask.
        bias = torch.full((s_q, s_k), float("-inf"), dtype=scores.dtype, device=q.device).triu(diagonal=s_k - s_q + 1)
        scores = scores + bias
        # Softmax in the activation dtype, as Megatron's fused softmax: it keeps a 2-byte output.
        probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, p, self.training)
        return torch.matmul(probs, v)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.core = CoreAttention(cfg.head_dim, cfg.dropout, cfg.fused_attention)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, 3, heads, d): heads inferred so a TP-sharded qkv gives the local heads.
        qkv = self.qkv(x).view(b, s, 3, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
        out = self.core(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GPTBlock(nn.Module):
    """Pre-LN transformer layer: x + drop(attn(ln1(x))), then + drop(mlp(ln2(.)))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.mlp_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_dropout(self.attn(self.ln1(x)))
        return x + self.mlp_dropout(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """tokens (b, s) int64 -> logits (b, s, vocab).

    ``_tp_plan`` is the model's Megatron tensor-parallel plan, written the way Hugging Face models
    carry theirs (model-relative patterns), so a model file needs no ``tp_plan`` line.
    """

    # qkv stacks q, k and v one after another (viewed as (3, heads, head_dim)): packed_colwise, as HF
    # marks such a layer, so each tp rank gets its slice of all three (executor/parallel/tensor_parallel.py).
    _tp_plan = {f"layers.*.{name}": style for name, style in {
        "attn.qkv": "packed_colwise", "attn.proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}.items()}

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Megatron init: N(0, 0.02), output projections scaled by 1/sqrt(2L), biases 0, norms 1."""
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scale = 1.0 / math.sqrt(2 * self.config.num_layers) if name.endswith(("proj", "fc2")) else 1.0
                if not (self.config.tie_embeddings and module is self.output):
                    nn.init.normal_(module.weight, 0.0, std * scale)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` lets a context-parallel shard say where its tokens sit in the sequence."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.emb_dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def example_tokens(cfg_seq_len: int, vocab_size: int, micro_batch_size: int) -> torch.Tensor:
    """Deterministic token ids of shape (micro_batch_size, seq_len) on the current default device."""
    n = micro_batch_size * cfg_seq_len
    ids = (torch.arange(n, dtype=torch.int64) * 7919 + 13) % vocab_size
    return ids.view(micro_batch_size, cfg_seq_len)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token i+1 from position i (last position has no target)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))


# block-relative, as a model file declares it (a declared colwise layer's fusion follows its width)
GPT_TP_PLAN = {k.removeprefix("layers.*."): v.removeprefix("packed_") for k, v in GPT._tp_plan.items()}


def model_file(config: GPTConfig) -> str:
    """The source of a model file (docs/design.md §3) for this config, e.g. to write next to a plan."""
    return f'''"""Megatron GPT: {config!r}"""
from autopar.models.gpt import GPT, GPT_TP_PLAN, GPTConfig, example_tokens, next_token_loss

CONFIG = {config!r}
SEQ_LEN = CONFIG.seq_len
tp_plan = GPT_TP_PLAN
pipeline_blocks = "layers"


def build_model():
    return GPT(CONFIG)


def example_inputs(micro_batch_size: int):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
'''
