"""Hugging Face BeitForImageClassification trained through ``labels``: a ViT whose every block holds its
own relative position bias table (one row of biases per head, indexed by a buffer of relative offsets)
added to the attention scores, layer scale on both residual branches, a bias on q and v but not on k,
and mean pooling of the patch tokens into the classifier.

Full size: BEiT-large/16 at 224 (24 layers, hidden 1024, 16 heads, MLP 4096, 1000 classes).
"""

import torch
from transformers import BeitConfig, BeitForImageClassification

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                 image_size=32, patch_size=8, num_labels=10),
    "full": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                 image_size=224, patch_size=16, num_labels=1000),
}
SIZE = "tiny"
CONFIG = BeitConfig(**SIZES[SIZE], use_relative_position_bias=True, use_mean_pooling=True,
                    layer_scale_init_value=0.1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    drop_path_rate=0.0)


def build_model():
    return BeitForImageClassification(CONFIG)


def example_inputs(micro_batch_size):
    return {"pixel_values": torch.randn(micro_batch_size, 3, CONFIG.image_size, CONFIG.image_size),
            "labels": torch.randint(0, CONFIG.num_labels, (micro_batch_size,))}


def loss_fn(output, inputs):
    return output.loss
