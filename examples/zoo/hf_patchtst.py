"""Hugging Face PatchTSTForPrediction (a time-series forecaster), trained through future_values.

Channel independence: every input channel's series is cut into overlapping patches and run through
the encoder on its own -- the model folds (batch x channels) into its batch inside the forward, and
its sequence is the patches, not the input's time steps. Loss: the mean squared error of the forecast.

Full size: a large PatchTST (24 layers, d_model 1024, 16 heads, FFN 4096) over 321 channels
(the Electricity set) with a 2048-step context in patches of 16 every 8 steps.
"""

import torch
from transformers import PatchTSTConfig, PatchTSTForPrediction

SIZES = {
    "tiny": dict(num_input_channels=3, context_length=64, patch_length=8, patch_stride=8, num_hidden_layers=4,
                 d_model=64, num_attention_heads=4, ffn_dim=128, prediction_length=16),
    "full": dict(num_input_channels=321, context_length=2048, patch_length=16, patch_stride=8, num_hidden_layers=24,
                 d_model=1024, num_attention_heads=16, ffn_dim=4096, prediction_length=96),
}
SIZE = "tiny"
CONFIG = PatchTSTConfig(**SIZES[SIZE], attention_dropout=0.0, positional_dropout=0.0, path_dropout=0.0,
                        ff_dropout=0.0, head_dropout=0.0, norm_type="layernorm", scaling="std")


def build_model():
    return PatchTSTForPrediction(CONFIG)


def example_inputs(micro_batch_size):
    n, c = CONFIG.context_length, CONFIG.num_input_channels
    t = torch.arange(n + CONFIG.prediction_length, dtype=torch.float32)
    phase = torch.rand(micro_batch_size, 1, c) * 6.28
    series = torch.sin(t[None, :, None] / 12.0 + phase) + 0.1 * torch.randn(micro_batch_size, len(t), c)
    return {"past_values": series[:, :n], "future_values": series[:, n:]}


def loss_fn(output, inputs):
    return output.loss
