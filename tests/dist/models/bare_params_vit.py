"""A plain-torch ViT-style classifier with bare ``nn.Parameter``s on the root: a class token and a
learned positional embedding used before the blocks, and a logit temperature used after them.
Blocks sit in an ``nn.ModuleList`` and return a tuple ``(x, None)`` that the loop unpacks, as some
libraries' layers do. A pipeline must place the bare parameters on the stages that use them.
"""

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, DEPTH, PATCH, IMAGE, CLASSES = 64, 4, 4, 4, 16, 10
NUM_PATCHES = (IMAGE // PATCH) ** 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # a key bias has ~0 gradient: Adam would amplify noise
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)))), None


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, DIM, kernel_size=PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, NUM_PATCHES + 1, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)
        self.logit_scale = nn.Parameter(torch.tensor([0.5]))  # 1-D: FSDP2 refuses scalar parameters

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x, _ = block(x)
        return self.head(self.norm(x)[:, 0]) * self.logit_scale.exp()


def build_model():
    return ViT()


def example_inputs(micro_batch_size: int):
    return torch.randn(micro_batch_size, 3, IMAGE, IMAGE)


def loss_fn(output, inputs):
    target = (inputs.mean(dim=(1, 2, 3)) * 1000).long() % CLASSES  # a fixed function of the image
    return F.cross_entropy(output.float(), target)
