"""Hugging Face Starcoder2ForCausalLM trained through ``labels``: biased projections, LayerNorm, GELU MLP
(c_fc / c_proj), GQA, a sliding window as long as the sequence.

Full size: StarCoder2-7B (32 layers, hidden 4608, 36 heads / 4 KV heads, MLP 18432, vocab 49152, 4096 tokens).
"""

import torch
from transformers import Starcoder2Config, Starcoder2ForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, sliding_window=32),
    "full": dict(num_hidden_layers=32, hidden_size=4608, intermediate_size=18432, num_attention_heads=36,
                 num_key_value_heads=4, vocab_size=49152, max_position_embeddings=4096, sliding_window=4096),
}
SIZE = "tiny"
CONFIG = Starcoder2Config(**SIZES[SIZE], use_cache=False, residual_dropout=0.0, embedding_dropout=0.0,
                          attention_dropout=0.0)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Starcoder2ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
