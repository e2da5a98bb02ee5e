"""Hugging Face SwitchTransformersForConditionalGeneration trained through ``labels``: an encoder-decoder
(T5 layout, relative position bias) whose every other block's MLP is a top-1 switch layer of experts in a
``ModuleDict`` with a per-expert capacity (tokens over capacity pass through), router losses added to
the loss.

Full size: switch-base-128 (12 + 12 layers, d_model 768, 12 heads of 64, d_ff 3072, 128 experts of
capacity 64 on every other layer, vocab 32128; planned with 512 source and 512 target tokens).
"""

import torch
from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

SIZES = {
    "tiny": dict(num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                 d_model=64, d_kv=16, d_ff=128, num_heads=4, num_experts=4, expert_capacity=64, vocab_size=256),
    "full": dict(num_layers=12, num_decoder_layers=12, num_sparse_encoder_layers=6, num_sparse_decoder_layers=6,
                 d_model=768, d_kv=64, d_ff=3072, num_heads=12, num_experts=128, expert_capacity=64,
                 vocab_size=32128),
}
SIZE = "tiny"
CONFIG = SwitchTransformersConfig(**SIZES[SIZE], dropout_rate=0.0, router_jitter_noise=0.0, use_cache=False,
                                  decoder_start_token_id=0, pad_token_id=0)
SEQ_LEN = 32 if SIZE == "tiny" else 512


def build_model():
    return SwitchTransformersForConditionalGeneration(CONFIG)


def example_inputs(micro_batch_size):
    src = torch.randint(1, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    labels = torch.randint(1, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": src, "labels": labels}


def loss_fn(output, inputs):
    return output.loss
