"""Hugging Face AlbertForMaskedLM: one transformer layer's weights applied at every depth (ALBERT's
cross-layer parameter sharing: ``encoder.albert_layer_groups`` holds one group that the encoder calls
``num_hidden_layers`` times), factorised embeddings (a small embedding projected up to the hidden width),
trained through ``labels`` (``output.loss``).

Full size: ALBERT-xxlarge (12 applications of one layer, hidden 4096, 64 heads of 64, MLP 16384,
embedding 128, vocab 30000, 512 tokens).
"""

import torch
from transformers import AlbertConfig, AlbertForMaskedLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                 embedding_size=32, vocab_size=256, max_position_embeddings=64),
    "full": dict(num_hidden_layers=12, hidden_size=4096, num_attention_heads=64, intermediate_size=16384,
                 embedding_size=128, vocab_size=30000, max_position_embeddings=512),
}
SIZE = "tiny"
CONFIG = AlbertConfig(**SIZES[SIZE], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      classifier_dropout_prob=0.0, attn_implementation="eager")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return AlbertForMaskedLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(5, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
