"""Hugging Face Qwen2ForCausalLM called the way the HF Trainer calls it: a dict of ``input_ids`` and
``labels``; the model computes its own shifted cross-entropy and ``loss_fn`` returns ``output.loss``.
Eager attention (set explicitly, as users do when they debug attention).

Full size: Qwen2-7B (28 layers, hidden 3584, 28 heads / 4 KV heads, MLP 18944, vocab 152064).
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=32),
    "full": dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = Qwen2Config(**SIZES[SIZE], use_cache=False, attn_implementation="eager")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Qwen2ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
