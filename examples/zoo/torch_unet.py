"""Plain-torch U-Net for semantic segmentation (Ronneberger et al. 2015, padded convolutions): a
contracting path of double-conv blocks with max-pooling between them, a bottleneck, and an expanding
path whose every block upsamples with a transposed conv and concatenates the feature map the
contracting block of the same resolution produced -- skip connections that cross the middle of the
network, kept in a Python list by the forward and popped on the way up. Per-pixel cross-entropy.

Full size: the paper's U-Net (depth 4, 64-1024 channels, 31 M parameters; 2 classes) on 512 x 512 images.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    "tiny": dict(base_channels=16, depth=3, num_classes=4, image_size=32),
    "full": dict(base_channels=64, depth=4, num_classes=2, image_size=512),
}
SIZE = "tiny"
CONFIG = SIZES[SIZE]


class DoubleConv(nn.Module):
    """Two 3x3 convs, each followed by GroupNorm (per sample, so ranks agree) and ReLU."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(8, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(x)))


class Up(nn.Module):
    """Upsample by 2, concatenate the skip connection, double conv."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.conv = DoubleConv(2 * c_out, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, base_channels: int, depth: int, num_classes: int, in_channels: int = 3) -> None:
        super().__init__()
        widths = [base_channels * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList([DoubleConv(in_channels, widths[0])]
                                  + [DoubleConv(widths[i], widths[i + 1]) for i in range(depth)])
        self.up = nn.ModuleList([Up(widths[i + 1], widths[i]) for i in reversed(range(depth))])
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()  # the bottleneck's output is the expanding path's input, not a skip
        for block in self.up:
            x = block(x, skips.pop())
        return self.head(x)


def build_model():
    return UNet(CONFIG["base_channels"], CONFIG["depth"], CONFIG["num_classes"])


def example_inputs(micro_batch_size):
    n = CONFIG["image_size"]
    return torch.randn(micro_batch_size, 3, n, n)


def loss_fn(output, inputs):
    # a fixed per-pixel target derived from the image (its brightest channel, binned), so every
    # layout sees the same labels without a second input
    target = inputs.argmax(dim=1) % output.shape[1]
    return F.cross_entropy(output, target)
