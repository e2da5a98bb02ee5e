"""Hugging Face Dinov2ForImageClassification trained through ``labels``: a ViT whose blocks scale each
residual branch by a learned per-channel vector (layer scale), a SwiGLU MLP in the giant size, position
embeddings interpolated to the image size, a classifier over the CLS token concatenated with the mean
patch token.

Full size: DINOv2 ViT-g/14 (40 layers, hidden 1536, 24 heads, SwiGLU MLP, patch 14, images of 224,
1000 classes).
"""

import torch
from transformers import Dinov2Config, Dinov2ForImageClassification

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, mlp_ratio=2, image_size=24,
                 patch_size=8, use_swiglu_ffn=True, num_labels=10),
    "full": dict(num_hidden_layers=40, hidden_size=1536, num_attention_heads=24, mlp_ratio=4, image_size=224,
                 patch_size=14, use_swiglu_ffn=True, num_labels=1000),
}
SIZE = "tiny"
CONFIG = Dinov2Config(**SIZES[SIZE], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)


def build_model():
    return Dinov2ForImageClassification(CONFIG)


def example_inputs(micro_batch_size):
    return {"pixel_values": torch.randn(micro_batch_size, 3, CONFIG.image_size, CONFIG.image_size),
            "labels": torch.randint(0, CONFIG.num_labels, (micro_batch_size,))}


def loss_fn(output, inputs):
    return output.loss
