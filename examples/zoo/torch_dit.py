"""Plain-torch DiT (Peebles & Xie 2023): a diffusion transformer on latent patches. Every block takes
the tokens and a conditioning vector (timestep + class embedding) and modulates its norms with
adaLN-Zero (shift, scale and gate from one Linear of the condition); the final layer is modulated the
same way. Loss: mean-squared error of the predicted noise.

Full size: DiT-XL/2 (28 blocks, hidden 1152, 16 heads, 32 x 32 x 4 latents in 2 x 2 patches: 256
tokens; 1000 classes).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    "tiny": dict(depth=4, hidden=64, heads=4, latent=8, channels=4, patch=2, classes=10),
    "full": dict(depth=28, hidden=1152, heads=16, latent=32, channels=4, patch=2, classes=1000),
}
SIZE = "tiny"
CFG = SIZES[SIZE]


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden, freq=256):
        super().__init__()
        self.freq = freq
        self.mlp = nn.Sequential(nn.Linear(freq, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t):
        half = self.freq // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * hidden, hidden))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class DiT(nn.Module):
    def __init__(self, depth, hidden, heads, latent, channels, patch, classes):
        super().__init__()
        self.patch, self.channels = patch, channels
        self.x_embedder = nn.Conv2d(channels, hidden, patch, stride=patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, (latent // patch) ** 2, hidden) + 0.02)
        self.t_embedder = TimestepEmbedder(hidden)
        self.y_embedder = nn.Embedding(classes, hidden)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads) for _ in range(depth))
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_mod = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.final = nn.Linear(hidden, patch * patch * channels)

    def forward(self, x, t, y, noise=None):  # noise: the target, read by loss_fn
        b, _, h, w = x.shape
        x = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_mod(c).chunk(2, dim=1)
        x = self.final(modulate(self.norm_final(x), shift, scale))
        p, gh, gw = self.patch, h // self.patch, w // self.patch
        x = x.reshape(b, gh, gw, p, p, self.channels).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, self.channels, h, w)


def build_model():
    return DiT(**CFG)


def example_inputs(micro_batch_size):
    b, s = micro_batch_size, CFG["latent"]
    return {"x": torch.randn(b, CFG["channels"], s, s), "t": torch.randint(0, 1000, (b,)),
            "y": torch.randint(0, CFG["classes"], (b,)), "noise": torch.randn(b, CFG["channels"], s, s)}


def loss_fn(output, inputs):
    return F.mse_loss(output, inputs["noise"])
