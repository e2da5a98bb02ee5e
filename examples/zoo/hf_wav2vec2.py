"""Hugging Face Wav2Vec2ForCTC trained through ``labels``: a stack of strided 1-D convs over raw audio
samples (the feature encoder), a convolutional position embedding, a pre-LN transformer encoder, and
the CTC loss over character labels. SpecAugment's random masking is off (it draws at every training step).

Full size: wav2vec 2.0 large (LV-60; 24 layers, hidden 1024, 16 heads, MLP 4096, seven 512-channel convs
of stride 5,2,2,2,2,2,2, 32 characters), 10 s of 16 kHz audio (499 frames) with 128 labels.
"""

import torch
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                 conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                 num_conv_pos_embedding_groups=4, vocab_size=32),
    "full": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                 conv_dim=(512,) * 7, conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_kernel=(10, 3, 3, 3, 3, 2, 2),
                 num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16, vocab_size=32),
}
SIZE = "tiny"
CONFIG = Wav2Vec2Config(**SIZES[SIZE], feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True,
                        apply_spec_augment=False, hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0,
                        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, ctc_loss_reduction="mean",
                        pad_token_id=0)
SAMPLES = 650 if SIZE == "tiny" else 160000  # raw audio samples per clip (tiny: 64 frames)
LABEL_LEN = 8 if SIZE == "tiny" else 128


def build_model():
    return Wav2Vec2ForCTC(CONFIG)


def example_inputs(micro_batch_size):
    return {"input_values": torch.randn(micro_batch_size, SAMPLES),
            "labels": torch.randint(1, CONFIG.vocab_size, (micro_batch_size, LABEL_LEN))}


def loss_fn(output, inputs):
    return output.loss
