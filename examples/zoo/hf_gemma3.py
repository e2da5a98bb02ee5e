"""Hugging Face Gemma3ForCausalLM (text) trained through ``labels``: five sliding-window layers to one
global layer, each kind with its own rotary table (the model computes a local and a global
``position_embeddings`` and hands each layer the one of its ``layer_types[i]``), RMS norms on q and k,
sandwich norms around attention and MLP, a scaled embedding tied to the head.

Full size: Gemma 3 4B's language model (34 layers, hidden 2560, 8 heads of 256 / 4 KV heads, MLP 10240,
vocab 262208, sliding window 1024, 4096 tokens).
"""

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

SIZES = {
    # one global layer after three sliding ones, so the tiny size runs both rotary tables and both masks
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, sliding_window=16,
                 layer_types=["sliding_attention"] * 3 + ["full_attention"], seq_len=64),
    "full": dict(num_hidden_layers=34, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024, seq_len=4096),
}
SIZE = "tiny"
_size = dict(SIZES[SIZE])
SEQ_LEN = _size.pop("seq_len")
CONFIG = Gemma3TextConfig(**_size, max_position_embeddings=SEQ_LEN, use_cache=False, attention_dropout=0.0)


def build_model():
    return Gemma3ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
