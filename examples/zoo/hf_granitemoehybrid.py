"""Hugging Face GraniteMoeHybridForCausalLM: Mamba-2 mixers in most layers and GQA attention in a
few, every layer's MLP a mixture of experts (stacked ``input_linear`` / ``output_linear``, top-k) beside
a shared MLP; Granite's scalar multipliers on the embedding, residuals and logits.

Full size: shaped as Granite-4.0-H-Tiny (40 layers, 4 of them attention, hidden 1536, 12 heads / 4 KV
heads, 64 experts of 512 top-6, shared MLP 1024, Mamba-2 48 heads of 64, state 128; vocab 100352,
4096 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

_FULL_TYPES = ["mamba"] * 40
for _i in (5, 15, 25, 35):
    _FULL_TYPES[_i] = "attention"
SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=32, shared_intermediate_size=64,
                 num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                 mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16, vocab_size=256,
                 max_position_embeddings=32, layer_types=["mamba", "attention", "mamba", "attention"]),
    "full": dict(num_hidden_layers=40, hidden_size=1536, intermediate_size=512, shared_intermediate_size=1024,
                 num_local_experts=64, num_experts_per_tok=6, num_attention_heads=12, num_key_value_heads=4,
                 mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_chunk_size=256, vocab_size=100352,
                 max_position_embeddings=4096, layer_types=_FULL_TYPES),
}
SIZE = "tiny"
CONFIG = GraniteMoeHybridConfig(**SIZES[SIZE], use_cache=False, mamba_n_groups=1, mamba_expand=2)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return GraniteMoeHybridForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
