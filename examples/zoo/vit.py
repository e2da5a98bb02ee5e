"""A timm-style Vision Transformer in plain torch: a conv patch-embed stem, a class token and learned
positions as bare ``nn.Parameter``s, the blocks in an ``nn.Sequential``, a final norm and a linear head
on the class token. Images in, classes out (no SEQ_LEN: the input is an image, not a token sequence).

Full size: ViT-H/14 (32 blocks, width 1280, 16 heads, MLP 5120, 224x224 images, 1000 classes).
"""

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    "tiny": dict(depth=4, dim=64, heads=4, mlp=128, image=16, patch=4, classes=10),
    "full": dict(depth=32, dim=1280, heads=16, mlp=5120, image=224, patch=14, classes=1000),
}
SIZE = "tiny"
CFG = SIZES[SIZE]


class PatchEmbed(nn.Module):
    def __init__(self, patch, dim):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, depth, dim, heads, mlp, image, patch, classes):
        super().__init__()
        self.patch_embed = PatchEmbed(patch, dim)
        num_patches = (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def build_model():
    return VisionTransformer(**CFG)


def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, 3, CFG["image"], CFG["image"])


def loss_fn(output, inputs):
    target = (inputs.mean(dim=(1, 2, 3)) * 1000).long() % CFG["classes"]  # a fixed function of the image
    return F.cross_entropy(output.float(), target)
