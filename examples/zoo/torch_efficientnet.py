"""Plain-torch EfficientNet (Tan & Le 2019), written as torchvision lays it out: a stem conv, stages of
MBConv blocks in ``features`` (an inverted bottleneck: 1x1 expansion, a depthwise k x k conv, a
squeeze-and-excitation gate computed from the globally pooled map, a 1x1 projection, a residual where
the shape allows), a 1x1 head conv, pooling and a classifier. Depthwise-separable convolutions and
squeeze-excite: conv kinds the zoo's ResNet and ConvNeXt lack. GroupNorm in place of BatchNorm (per
sample, so 2 ranks compare with 1), dropout and stochastic depth off.

Full size: EfficientNet-B0 (16 MBConv blocks in 7 stages, 5.3 M parameters, 1000 classes) at 224 x 224.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

# (expand ratio, kernel, stride, out channels, repeats) per stage: EfficientNet-B0's table
B0 = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
      (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]
SIZES = {
    "tiny": dict(stages=[(1, 3, 1, 16, 1), (4, 3, 2, 24, 2), (4, 5, 2, 32, 1)], stem=16, head=64,
                 num_classes=10, image_size=32),
    "full": dict(stages=B0, stem=32, head=1280, num_classes=1000, image_size=224),
}
SIZE = "tiny"
CONFIG = SIZES[SIZE]


def _norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(8 if c % 8 == 0 else 1, c)


class ConvNormAct(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> None:
        super().__init__(nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False), _norm(c_out),
                         nn.SiLU() if act else nn.Identity())


class SqueezeExcite(nn.Module):
    def __init__(self, c: int, squeezed: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, squeezed, 1), nn.Conv2d(squeezed, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(self.fc2(F.silu(self.fc1(s))))


class MBConv(nn.Module):
    def __init__(self, c_in: int, c_out: int, expand: int, kernel: int, stride: int) -> None:
        super().__init__()
        mid = c_in * expand
        layers = [ConvNormAct(c_in, mid, 1)] if expand != 1 else []
        layers += [ConvNormAct(mid, mid, kernel, stride, groups=mid), SqueezeExcite(mid, max(1, c_in // 4)),
                   ConvNormAct(mid, c_out, 1, act=False)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class EfficientNet(nn.Module):
    def __init__(self, stages: list, stem: int, head: int, num_classes: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = [ConvNormAct(3, stem, 3, 2)]
        c = stem
        for expand, kernel, stride, c_out, repeats in stages:
            blocks.append(nn.Sequential(*[MBConv(c if i == 0 else c_out, c_out, expand, kernel, stride if i == 0 else 1)
                                          for i in range(repeats)]))
            c = c_out
        blocks.append(ConvNormAct(c, head, 1))
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Linear(head, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        return self.classifier(x)


def build_model():
    return EfficientNet(CONFIG["stages"], CONFIG["stem"], CONFIG["head"], CONFIG["num_classes"])


def example_inputs(micro_batch_size):
    n = CONFIG["image_size"]
    return torch.randn(micro_batch_size, 3, n, n)


def loss_fn(output, inputs):
    # a fixed class per image derived from its pixels, so every layout sees the same labels
    target = (inputs.mean(dim=(1, 2, 3)) > 0).long()
    return F.cross_entropy(output, target)
