"""Hugging Face SegformerForSemanticSegmentation trained through ``labels``: a hierarchical encoder of four
stages (overlapping strided conv patch embeddings, efficient self-attention whose keys and values are
spatially reduced by a strided conv, a depthwise conv in the MLP) of growing width, and an all-MLP decode
head that upsamples every stage to one map; per-pixel cross-entropy.

Full size: SegFormer-B5 (stages of 3, 6, 40, 3 blocks, widths 64, 128, 320, 512, 150 ADE20K classes,
images of 512).
"""

import torch
from transformers import SegformerConfig, SegformerForSemanticSegmentation

SIZES = {
    "tiny": dict(num_encoder_blocks=2, depths=[2, 2], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                 patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[4, 4],
                 decoder_hidden_size=32, num_labels=10, image_size=32),
    "full": dict(num_encoder_blocks=4, depths=[3, 6, 40, 3], sr_ratios=[8, 4, 2, 1], hidden_sizes=[64, 128, 320, 512],
                 patch_sizes=[7, 3, 3, 3], strides=[4, 2, 2, 2], num_attention_heads=[1, 2, 5, 8],
                 mlp_ratios=[4, 4, 4, 4], decoder_hidden_size=768, num_labels=150, image_size=512),
}
SIZE = "tiny"
CONFIG = SegformerConfig(**SIZES[SIZE], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         classifier_dropout_prob=0.0, drop_path_rate=0.0)


def build_model():
    return SegformerForSemanticSegmentation(CONFIG)


def example_inputs(micro_batch_size):
    size = CONFIG.image_size
    return {"pixel_values": torch.randn(micro_batch_size, 3, size, size),
            "labels": torch.randint(0, CONFIG.num_labels, (micro_batch_size, size, size))}


def loss_fn(output, inputs):
    return output.loss
