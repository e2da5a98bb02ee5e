"""Hugging Face ViTMAEForPreTraining: a masked autoencoder -- the encoder sees a random 25 % of the
patches (its own ``torch.rand`` noise every forward, argsort-shuffled), a narrower decoder rebuilds
every patch; the loss (``output.loss``) is the normalised pixels' error on the masked ones.

Full size: ViT-MAE-large (24 encoder layers of 1024, 16 heads; decoder 8 layers of 512; 224 x 224 images,
16 x 16 patches).
"""

import torch
from transformers import ViTMAEConfig, ViTMAEForPreTraining

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 decoder_num_hidden_layers=2, decoder_hidden_size=32, decoder_intermediate_size=64,
                 decoder_num_attention_heads=4, image_size=32, patch_size=8),
    "full": dict(num_hidden_layers=24, hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                 decoder_num_hidden_layers=8, decoder_hidden_size=512, decoder_intermediate_size=2048,
                 decoder_num_attention_heads=16, image_size=224, patch_size=16),
}
SIZE = "tiny"
CONFIG = ViTMAEConfig(**SIZES[SIZE], mask_ratio=0.75, norm_pix_loss=True)


def build_model():
    return ViTMAEForPreTraining(CONFIG)


def example_inputs(micro_batch_size):
    patches = (CONFIG.image_size // CONFIG.patch_size) ** 2
    return {"pixel_values": torch.randn(micro_batch_size, 3, CONFIG.image_size, CONFIG.image_size),
            "noise": torch.rand(micro_batch_size, patches)}


def loss_fn(output, inputs):
    return output.loss
