"""Hugging Face GPT2LMHeadModel: fused ``c_attn`` and MLP in HF's ``Conv1D`` (weights stored transposed),
learned positions, tied embeddings. Eager attention, as GPT-2 fine-tuning scripts often set it.

Full size: GPT-2 XL (48 layers, hidden 1600, 25 heads, vocab 50257, 1024 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

SIZES = {
    "tiny": dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0),
    "full": dict(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024),
}
SIZE = "tiny"
CONFIG = GPT2Config(**SIZES[SIZE], use_cache=False, attn_implementation="eager",
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
SEQ_LEN = CONFIG.n_positions
VOCAB = CONFIG.vocab_size


def build_model():
    return GPT2LMHeadModel(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, VOCAB, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    # Reshaping with the vocabulary constant, as many training scripts do.
    return F.cross_entropy(output.logits[:, :-1].reshape(-1, VOCAB).float(), inputs[:, 1:].reshape(-1))
