"""A conv stem whose channel count equals SEQ_LEN (Whisper's mel bins at a short SEQ_LEN): the inputs are
(batch, 16 channels, 16 frames), and only the frames are the sequence. Cutting the first dimension of
size 16 breaks the stem; the planner must find the frames by how the model takes them."""
import torch
from torch import nn

SEQ_LEN = 16
CHANNELS = 16
DIM = 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(CHANNELS, DIM, kernel_size=3, padding=1)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(DIM, 10)

    def forward(self, features):
        x = self.stem(features).transpose(1, 2)  # (batch, frames, DIM)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, CHANNELS, SEQ_LEN)


def loss_fn(output, inputs):
    return output.float().pow(2).mean()
