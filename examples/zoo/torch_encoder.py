"""A sequence classifier on ``torch.nn.TransformerEncoder`` (pre-norm ``TransformerEncoderLayer``,
``batch_first=True``), learned positions from an ``nn.Embedding``, mean pooling and a linear head.
Dropout off so runs are comparable across layouts.

Full size: BERT-large-shaped (24 layers, d_model 1024, 16 heads, FFN 4096, vocab 30522, 512 tokens).
"""

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    "tiny": dict(layers=4, d_model=64, heads=4, ffn=128, vocab=256, seq=32, classes=8),
    "full": dict(layers=24, d_model=1024, heads=16, ffn=4096, vocab=30522, seq=512, classes=8),
}
SIZE = "tiny"
CFG = SIZES[SIZE]
SEQ_LEN = CFG["seq"]


class EncoderClassifier(nn.Module):
    def __init__(self, layers, d_model, heads, ffn, vocab, seq, classes):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ffn, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.encoder(self.tokens(ids) + self.positions(pos))
        return self.head(h.mean(dim=1))


def build_model():
    return EncoderClassifier(**CFG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CFG["vocab"], (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    target = inputs.sum(dim=1) % CFG["classes"]  # a learnable function of the tokens
    return F.cross_entropy(output.float(), target)
