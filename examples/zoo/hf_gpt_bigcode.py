"""Hugging Face GPTBigCodeForCausalLM: multi-query attention through one fused ``c_attn`` (q of h, one
shared k and v of a head each), learned positions, a head tied to the token embedding.

Full size: StarCoderBase-1B (24 layers, hidden 2048, 16 heads, one KV head, vocab 49152, 8192 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

SIZES = {
    "tiny": dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=32),
    "full": dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=49152, n_positions=8192),
}
SIZE = "tiny"
CONFIG = GPTBigCodeConfig(**SIZES[SIZE], multi_query=True, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0)
SEQ_LEN = CONFIG.n_positions


def build_model():
    return GPTBigCodeForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
