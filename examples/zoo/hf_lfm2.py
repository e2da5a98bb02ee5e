"""Hugging Face Lfm2ForCausalLM: a hybrid of short gated convolutions (most layers) and GQA attention
(some), each with a SwiGLU MLP; two block kinds in one ``model.layers`` list.

Full size: LFM2-1.2B (16 layers, 6 of them attention, hidden 2048, 32 heads / 8 KV heads, vocab 65536,
4096 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import Lfm2Config, Lfm2ForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=32,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "full": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=12288, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=65536, max_position_embeddings=4096,
                 layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                              "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
                              "full_attention", "conv"]),
}
SIZE = "tiny"
CONFIG = Lfm2Config(**SIZES[SIZE], use_cache=False)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Lfm2ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
