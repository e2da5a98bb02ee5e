"""A decoder whose every block attends to an encoder's output passed as ``memory=`` (as Whisper's and
T5's decoders do): a pipeline computes the encoder once on the first stage and carries its output
beside the hidden state to every later stage. The encoder's output is wider than the hidden state
and as long as the token sequence, so its bytes scale with the micro-batch and the sequence.
``CARRY = False`` is the same model with the encoder's output added to the hidden state before the
blocks instead (nothing carried)."""

import torch
import torch.nn.functional as F
from torch import nn

DIM, ENC, VOCAB, DEPTH, SEQ_LEN = 64, 256, 128, 4, 32
CARRY = True
pipeline_blocks = "blocks"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM)
        self.kv = nn.Linear(ENC, 2 * DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x, memory=None):
        if memory is not None:
            k, v = self.kv(memory).unsqueeze(1).chunk(2, dim=-1)  # one head
            x = x + F.scaled_dot_product_attention(self.q(self.norm(x)).unsqueeze(1), k, v).squeeze(1)
        return x + self.fc2(F.gelu(self.fc1(x)))


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.Sequential(nn.Embedding(VOCAB, ENC), nn.Linear(ENC, ENC))
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        memory = self.encoder(tokens)
        if not CARRY:
            x, memory = x + memory[..., :DIM], None
        for block in self.blocks:
            x = block(x, memory=memory)
        return self.head(self.norm(x))


def build_model():
    return EncoderDecoder()


def example_inputs(micro_batch_size: int):
    return torch.randint(0, VOCAB, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return F.cross_entropy(output[:, :-1].flatten(0, 1).float(), inputs[:, 1:].flatten())
