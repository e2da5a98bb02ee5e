"""Hugging Face MixtralForCausalLM, tiny, from a config (needs transformers). ``EXPERTS`` picks the
experts implementation: "grouped_mm" (transformers' default: one ``torch._grouped_mm`` per
projection) or "eager" (a loop over the experts hit, ``nonzero`` / ``torch.where`` routing)."""

import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

EXPERTS = "grouped_mm"  # tests/unit/test_moe.py writes copies with "eager"
CONFIG = MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                       max_position_embeddings=32, use_cache=False, experts_implementation=EXPERTS)
SEQ_LEN = 32


def build_model():
    return MixtralForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
