"""Hugging Face CohereForCausalLM trained through ``labels`` (``loss_fn`` returns ``output.loss``):
parallel attention and MLP off one LayerNorm without bias, the logits scaled by ``logit_scale``
inside the model before its own loss, tied embeddings.

Full size: Aya-23-8B (32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336, vocab 256000, 4096 tokens
here).
"""

import torch
from transformers import CohereConfig, CohereForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=32,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "full": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=256000, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = CohereConfig(**SIZES[SIZE], use_cache=False, logit_scale=0.0625, attention_dropout=0.0,
                      attn_implementation="eager")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return CohereForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
