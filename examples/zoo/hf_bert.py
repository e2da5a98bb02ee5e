"""Hugging Face BertForMaskedLM, trained as an auto-encoder on its own tokens (post-LayerNorm blocks,
absolute positions, token types, a tied MLM head). Dropout off so runs are comparable across layouts.

Full size: BERT-large (24 layers, hidden 1024, 16 heads, MLP 4096, vocab 30522, 512 tokens).
"""

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 vocab_size=256, max_position_embeddings=32),
    "full": dict(num_hidden_layers=24, hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                 vocab_size=30522, max_position_embeddings=512),
}
SIZE = "tiny"
CONFIG = BertConfig(**SIZES[SIZE], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return BertForMaskedLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), inputs.reshape(-1))
