"""Hugging Face MllamaForCausalLM (the text model of Llama 3.2 Vision) trained on text through
``labels``: self-attention decoder layers with gated cross-attention layers interleaved in the same
``model.layers`` list (every fifth layer attends to image features through tanh-gated attention and
MLP); a text-only batch has no image features, so the model's own forward skips those layers -- blocks
that hold parameters and do not run.

Full size: Llama-3.2-11B-Vision's text model (40 layers, 8 of them cross-attention, hidden 4096, 32 heads /
8 KV heads of 128, MLP 14336, vocab 128256; planned at 4096 tokens).
"""

import torch
from transformers import MllamaForCausalLM, MllamaTextConfig

SIZES = {
    "tiny": dict(num_hidden_layers=5, cross_attention_layers=[3], hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=64, pad_token_id=0),
    "full": dict(num_hidden_layers=40, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38], hidden_size=4096,
                 num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, pad_token_id=128004,
                 max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = MllamaTextConfig(**SIZES[SIZE], use_cache=False)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return MllamaForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
