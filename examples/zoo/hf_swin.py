"""HF SwinForImageClassification: four stages of windowed-attention blocks of growing width."""
import torch
from transformers import SwinConfig, SwinForImageClassification

SIZES = {
    "tiny": dict(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, drop_path_rate=0.0,
                 num_labels=10),
    "full": dict(image_size=224, patch_size=4, embed_dim=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32],
                 window_size=7, num_labels=1000, drop_path_rate=0.0),
}
SIZE = "tiny"
CONFIG = SwinConfig(**SIZES[SIZE])


def build_model():
    return SwinForImageClassification(CONFIG)


def example_inputs(micro_batch_size):
    return {"pixel_values": torch.randn(micro_batch_size, 3, CONFIG.image_size, CONFIG.image_size),
            "labels": torch.randint(0, CONFIG.num_labels, (micro_batch_size,))}


def loss_fn(output, inputs):
    return output.loss
