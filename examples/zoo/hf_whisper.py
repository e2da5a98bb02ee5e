"""Hugging Face WhisperForConditionalGeneration trained through labels: a conv stem over mel frames, an
encoder and a decoder (two block lists), cross-attention.

Full size: Whisper large-v3 (32 + 32 layers, d_model 1280, 20 heads, 128 mel bins, 1500 positions).
"""

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

SIZES = {
    "tiny": dict(encoder_layers=2, decoder_layers=2, d_model=64, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                 max_source_positions=32, max_target_positions=32, vocab_size=256),
    "full": dict(encoder_layers=32, decoder_layers=32, d_model=1280, encoder_attention_heads=20,
                 decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128,
                 max_source_positions=1500, max_target_positions=448, vocab_size=51866),
}
SIZE = "tiny"
CONFIG = WhisperConfig(**SIZES[SIZE], use_cache=False, pad_token_id=0, decoder_start_token_id=1)
SEQ_LEN = 16 if SIZE == "tiny" else 448  # decoder tokens; the encoder takes 2 x max_source_positions frames


def build_model():
    return WhisperForConditionalGeneration(CONFIG)


def example_inputs(micro_batch_size):
    features = torch.randn(micro_batch_size, CONFIG.num_mel_bins, 2 * CONFIG.max_source_positions)
    labels = torch.randint(2, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_features": features, "labels": labels}


def loss_fn(output, inputs):
    return output.loss
