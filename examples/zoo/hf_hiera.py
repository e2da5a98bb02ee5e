"""Hugging Face HieraForImageClassification (a hierarchical ViT with no convolutions past the stem),
trained through labels.

Four stages of widening blocks (a stage's first block pools its queries 2 x 2 and doubles the
width), attention within mask units in the first two stages and global after, tokens kept in the
mask-unit order ("unrolled") so that pooling is a reshape.

Full size: Hiera-L (depths 2 / 6 / 36 / 4, width 144 to 1152, 224 x 224 images, 1000 classes).
"""

import torch
from transformers import HieraConfig, HieraForImageClassification

SIZES = {
    "tiny": dict(embed_dim=32, depths=[1, 2, 2, 1], num_heads=[1, 2, 4, 8], image_size=[64, 64], num_labels=10),
    "full": dict(embed_dim=144, depths=[2, 6, 36, 4], num_heads=[2, 4, 8, 16], image_size=[224, 224], num_labels=1000),
}
SIZE = "tiny"
CONFIG = HieraConfig(**SIZES[SIZE], drop_path_rate=0.0)


def build_model():
    return HieraForImageClassification(CONFIG)


def example_inputs(micro_batch_size):
    size = CONFIG.image_size
    return {"pixel_values": torch.randn(micro_batch_size, 3, size[0], size[1]),
            "labels": torch.randint(0, CONFIG.num_labels, (micro_batch_size,))}


def loss_fn(output, inputs):
    return output.loss
