"""Hugging Face MusicgenForCausalLM (MusicGen's decoder over EnCodec tokens), trained through labels.

Four codebooks per time step: HF's decoder takes its token rows as (batch x codebooks) -- sample-major,
one row per codebook -- sums four embeddings into one hidden state per step, and four heads predict
the next step's four codes (labels of shape (batch, seq, codebooks)). autopar splits dim 0 of every
input across ranks and micro-batches, so the file hands the codes over as (batch, codebooks, seq) and
a wrapper folds them into rows inside the forward (autopar's error for the folded rows says so).

Full size: MusicGen-medium's decoder (48 layers, hidden 1536, 24 heads, FFN 6144, 4 codebooks of
2048 codes).
"""

import torch
from torch import nn
from transformers import MusicgenDecoderConfig, MusicgenForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, ffn_dim=128, vocab_size=64,
                 max_position_embeddings=128),
    "full": dict(num_hidden_layers=48, hidden_size=1536, num_attention_heads=24, ffn_dim=6144, vocab_size=2048,
                 max_position_embeddings=2048),
}
SIZE = "tiny"
CODEBOOKS = 4
_V = SIZES[SIZE]["vocab_size"]  # the start / pad code is one past the codebook (an extra embedding row)
CONFIG = MusicgenDecoderConfig(**SIZES[SIZE], num_codebooks=CODEBOOKS, pad_token_id=_V, bos_token_id=_V, dropout=0.0,
                               attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, use_cache=False)
SEQ_LEN = 1500 if SIZE == "full" else 32  # 30 s of audio at EnCodec's 50 Hz frames


class MusicGen(nn.Module):
    """MusicGen's decoder on codes of shape (batch, codebooks, seq)."""

    def __init__(self):
        super().__init__()
        self.lm = MusicgenForCausalLM(CONFIG)

    def forward(self, codes, labels):
        return self.lm(input_ids=codes.reshape(-1, codes.shape[-1]), labels=labels)


def build_model():
    return MusicGen()


def example_inputs(micro_batch_size):
    codes = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN, CODEBOOKS))
    return {"codes": codes.permute(0, 2, 1).contiguous(), "labels": codes}


def loss_fn(output, inputs):
    return output.loss
