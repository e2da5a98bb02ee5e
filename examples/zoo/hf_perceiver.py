"""Hugging Face PerceiverForMaskedLM trained through ``labels`` on UTF-8 bytes: one cross-attention
reads the 2048 input positions into 256 latents, a stack of self-attention layers runs on the latents
only (the blocks' sequence is not the input's), and a decoder cross-attends from 2048 position queries
back to the latents before the byte head tied to the input embedding.

Full size: Perceiver IO language model (deepmind/language-perceiver: 26 latent self-attention layers,
256 latents of 1280, inputs of 768, vocab 262 bytes, 2048 positions).
"""

import torch
from transformers import PerceiverConfig, PerceiverForMaskedLM

SIZES = {
    "tiny": dict(num_latents=16, d_latents=64, d_model=32, num_self_attends_per_block=4,
                 num_self_attention_heads=4, num_cross_attention_heads=4, max_position_embeddings=64),
    "full": dict(num_latents=256, d_latents=1280, d_model=768, num_self_attends_per_block=26,
                 num_self_attention_heads=8, num_cross_attention_heads=8, max_position_embeddings=2048),
}
SIZE = "tiny"
CONFIG = PerceiverConfig(**SIZES[SIZE], vocab_size=262, qk_channels=None, v_channels=None,
                         attention_probs_dropout_prob=0.0)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return PerceiverForMaskedLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"inputs": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
