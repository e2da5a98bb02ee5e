"""A ResNet in the torchvision layout (``conv1``, ``layer1``..``layer4``, ``avgpool``, ``fc``): bottleneck
blocks, four stages of growing width and shrinking resolution, so no two stages have the same shapes.
GroupNorm instead of BatchNorm (as in BiT): batch statistics would make data-parallel ranks differ
from one process by design. Images in, classes out; no SEQ_LEN.

Full size: ResNet-152 shape (stages of 3, 8, 36, 3 bottlenecks, widths 256..2048, 224x224, 1000 classes).
"""

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    "tiny": dict(depths=(1, 1, 1, 1), base=8, image=16, classes=10),
    "full": dict(depths=(3, 8, 36, 3), base=64, image=224, classes=1000),
}
SIZE = "tiny"
CFG = SIZES[SIZE]


def norm(channels):
    return nn.GroupNorm(min(32, channels // 4), channels)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch, width, stride):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = norm(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = norm(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = norm(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), norm(out_ch))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, depths, base, image, classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False)
        self.bn1 = norm(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = base
        for i, depth in enumerate(depths):
            width = base * 2**i
            blocks = []
            for j in range(depth):
                blocks.append(Bottleneck(in_ch, width, stride=2 if (i > 0 and j == 0) else 1))
                in_ch = width * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model():
    return ResNet(**CFG)


def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, 3, CFG["image"], CFG["image"])


def loss_fn(output, inputs):
    target = (inputs.mean(dim=(1, 2, 3)) * 1000).long() % CFG["classes"]
    return F.cross_entropy(output.float(), target)
