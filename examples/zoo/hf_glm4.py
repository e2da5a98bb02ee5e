"""Hugging Face Glm4ForCausalLM trained through ``labels``: a dict of ``input_ids`` and ``labels``,
``loss_fn`` returns ``output.loss``. Fused ``gate_up_proj`` (chunked in two), partial rotary,
sandwich norms (a norm after attention and after the MLP as well as before), GQA with 2 KV heads,
biased q/k/v.

Full size: GLM-4-9B (40 layers, hidden 4096, 32 heads / 2 KV heads, MLP 13696, vocab 151552; 4096 tokens
here).
"""

import torch
from transformers import Glm4Config, Glm4ForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=32,
                 pad_token_id=0, eos_token_id=[1, 2]),
    "full": dict(num_hidden_layers=40, hidden_size=4096, intermediate_size=13696, num_attention_heads=32,
                 num_key_value_heads=2, head_dim=128, vocab_size=151552, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = Glm4Config(**SIZES[SIZE], use_cache=False, attention_bias=True, attention_dropout=0.0,
                    attn_implementation="sdpa")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Glm4ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
