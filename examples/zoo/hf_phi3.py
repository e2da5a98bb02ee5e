"""Hugging Face Phi3ForCausalLM: fused ``qkv_proj`` and fused ``gate_up_proj`` Linear layers, RoPE,
``use_cache=False``, eager attention.

Full size: Phi-3-mini (32 layers, hidden 3072, 32 heads, MLP 8192, vocab 32064, 4096 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import Phi3Config, Phi3ForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=32,
                 original_max_position_embeddings=32, bos_token_id=1, eos_token_id=2),
    "full": dict(num_hidden_layers=32, hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
                 original_max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = Phi3Config(**SIZES[SIZE], use_cache=False, attn_implementation="eager", pad_token_id=0,
                    resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Phi3ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
