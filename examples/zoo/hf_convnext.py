"""Hugging Face ConvNextForImageClassification trained through ``labels``: a conv net of stages of
different widths (a strided conv downsampling between them), each block a 7x7 depthwise conv, a
channels-last LayerNorm, a pointwise MLP as ``nn.Linear`` layers and a layer-scale vector.

Full size: ConvNeXt-L (stages of 3, 3, 27, 3 blocks, widths 192, 384, 768, 1536, images of 224,
1000 classes).
"""

import torch
from transformers import ConvNextConfig, ConvNextForImageClassification

SIZES = {
    "tiny": dict(num_stages=2, depths=[2, 2], hidden_sizes=[16, 32], image_size=32, num_labels=10),
    "full": dict(num_stages=4, depths=[3, 3, 27, 3], hidden_sizes=[192, 384, 768, 1536], image_size=224,
                 num_labels=1000),
}
SIZE = "tiny"
CONFIG = ConvNextConfig(**SIZES[SIZE], drop_path_rate=0.0)


def build_model():
    return ConvNextForImageClassification(CONFIG)


def example_inputs(micro_batch_size):
    return {"pixel_values": torch.randn(micro_batch_size, 3, CONFIG.image_size, CONFIG.image_size),
            "labels": torch.randint(0, CONFIG.num_labels, (micro_batch_size,))}


def loss_fn(output, inputs):
    return output.loss
