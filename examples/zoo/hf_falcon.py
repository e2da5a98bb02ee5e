"""Hugging Face FalconForCausalLM (the "new decoder architecture" of Falcon-40B/180B): attention and
MLP in parallel from one input, grouped fused ``query_key_value``, and the block adds the attention
output to the MLP output in place (``mlp_output += attention_output``). Dict of ``input_ids`` and
``labels``, ``output.loss``.

Full size: Falcon-40B (60 layers, hidden 8192, 128 heads / 8 KV heads, vocab 65024, 2048 tokens).
"""

import torch
from transformers import FalconConfig, FalconForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2, vocab_size=256,
                 max_position_embeddings=32),
    "full": dict(num_hidden_layers=60, hidden_size=8192, num_attention_heads=128, num_kv_heads=8, vocab_size=65024,
                 max_position_embeddings=2048),
}
SIZE = "tiny"
CONFIG = FalconConfig(**SIZES[SIZE], new_decoder_architecture=True, use_cache=False, hidden_dropout=0.0,
                      attention_dropout=0.0)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return FalconForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
