"""Hugging Face Gemma2ForCausalLM: sliding-window and global attention alternating by layer, picked by
loop position (``config.layer_types[i]``), logit soft-capping, a scaled embedding with a buffer, an
output head tied to it, ``(1 + weight)`` RMSNorms. Dict of ``input_ids`` and ``labels``,
``output.loss``.

Full size: Gemma-2 9B (42 layers, hidden 3584, 16 heads of 256 / 8 KV heads, MLP 14336, vocab 256000,
sliding window 4096).
"""

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=32, sliding_window=16),
    "full": dict(num_hidden_layers=42, hidden_size=3584, intermediate_size=14336, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                 sliding_window=4096),
}
SIZE = "tiny"
CONFIG = Gemma2Config(**SIZES[SIZE], use_cache=False, attention_dropout=0.0)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Gemma2ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
