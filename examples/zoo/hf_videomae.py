"""Hugging Face VideoMAEForVideoClassification (a video ViT over space-time tubelets), trained through labels.

Input: (batch, frames, channels, height, width); a 3-D convolution cuts it into tubelets of 2 frames
x 16 x 16 pixels (8 x 14 x 14 = 1568 tokens at full size), fixed sin-cos positions (a buffer), mean
pooling, query/value biases as bare parameters beside a bias-less key.

Full size: VideoMAE-large on Kinetics-400 (24 layers, hidden 1024, 16 heads, 16 frames of 224 x 224).
"""

import torch
from transformers import VideoMAEConfig, VideoMAEForVideoClassification

SIZES = {
    "tiny": dict(image_size=32, patch_size=8, num_frames=4, tubelet_size=2, hidden_size=64, num_hidden_layers=4,
                 num_attention_heads=4, intermediate_size=128, num_labels=10),
    "full": dict(image_size=224, patch_size=16, num_frames=16, tubelet_size=2, hidden_size=1024,
                 num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, num_labels=400),
}
SIZE = "tiny"
CONFIG = VideoMAEConfig(**SIZES[SIZE], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def build_model():
    return VideoMAEForVideoClassification(CONFIG)


def example_inputs(micro_batch_size):
    c = CONFIG
    video = torch.randn(micro_batch_size, c.num_frames, c.num_channels, c.image_size, c.image_size)
    return {"pixel_values": video, "labels": torch.randint(0, c.num_labels, (micro_batch_size,))}


def loss_fn(output, inputs):
    return output.loss
