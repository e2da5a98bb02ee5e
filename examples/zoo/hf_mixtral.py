"""Hugging Face MixtralForCausalLM: a sparse mixture of experts (top-2 routing) in every block, GQA,
sliding window off. ``use_cache=False``, default attention, next-token loss on ``output.logits``
(the router's auxiliary loss is not added, as with ``output_router_logits=False``, the default).

Full size: Mixtral 8x7B (32 layers, hidden 4096, 32 heads / 8 KV heads, 8 experts of 14336, top-2,
vocab 32000, 4096 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                 max_position_embeddings=32),
    "full": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                 max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = MixtralConfig(**SIZES[SIZE], use_cache=False)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return MixtralForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
