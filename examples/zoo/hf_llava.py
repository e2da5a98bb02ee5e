"""Hugging Face LlavaForConditionalGeneration trained through ``labels``: a vision-language model fed
``pixel_values`` and ``input_ids`` together. A CLIP vision tower encodes the image, the features of its
second-to-last layer (CLS dropped) go through a two-layer GELU projector, and are scattered into the
token embeddings at the image-token positions (``masked_scatter``) before a Llama decoder; two block
lists of different widths, the vision tower before the language model.

Full size: LLaVA-1.5-7B (CLIP ViT-L/14 at 336 px: 24 layers, hidden 1024, 16 heads, 577 positions;
Llama-2-7B: 32 layers, hidden 4096, 32 heads, MLP 11008, vocab 32064; 576 image tokens in 2048).
"""

import torch
from transformers import LlavaConfig, LlavaForConditionalGeneration

SIZES = {
    "tiny": dict(vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=32, patch_size=8),
                 text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=4, vocab_size=256, max_position_embeddings=64),
                 image_token_index=255, seq_len=64),
    "full": dict(vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                    num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768),
                 text_config=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                                  max_position_embeddings=4096),
                 image_token_index=32000, seq_len=2048),
}
SIZE = "tiny"
_size = dict(SIZES[SIZE])
SEQ_LEN = _size.pop("seq_len")
_vision = dict(_size.pop("vision_config"), model_type="clip_vision_model")
_text = dict(_size.pop("text_config"), model_type="llama")
CONFIG = LlavaConfig(vision_config=_vision, text_config=_text, **_size,
                     image_seq_length=(_vision["image_size"] // _vision["patch_size"]) ** 2)
CONFIG.text_config.use_cache = False


def build_model():
    return LlavaForConditionalGeneration(CONFIG)


def _batch(batch_size, generator=None):
    # a chat-style sample: one image's tokens after a one-token prefix, then text; the image positions
    # are not scored (labels -100), as LLaVA's instruction tuning leaves them
    v, n_img = CONFIG.vision_config, CONFIG.image_seq_length
    ids = torch.randint(0, CONFIG.image_token_index, (batch_size, SEQ_LEN), generator=generator)
    ids[:, 1:1 + n_img] = CONFIG.image_token_index
    labels = ids.clone()
    labels[:, 1:1 + n_img] = -100
    pixels = torch.randn(batch_size, 3, v.image_size, v.image_size, generator=generator)
    return {"input_ids": ids, "pixel_values": pixels, "labels": labels}


def example_inputs(micro_batch_size):
    return _batch(micro_batch_size)


def dataset(global_batch_size, step, seed):
    # the collator's job: image tokens where the image goes (random ids would hold none)
    return _batch(global_batch_size, torch.Generator().manual_seed(seed * 100_003 + step))


def loss_fn(output, inputs):
    return output.loss
