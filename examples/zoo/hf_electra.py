"""Hugging Face ElectraForPreTraining (the discriminator) trained through ``labels``: a post-LN BERT-style
encoder behind factorised embeddings (``embedding_size`` smaller than the hidden size, projected up by
``embeddings_project`` in the tiny size), and a per-token binary head (replaced or original) whose loss
is a BCE over 0/1 labels the shape of the ids, not a cross-entropy over a vocabulary.

Full size: ELECTRA-large discriminator (24 layers, hidden 1024, 16 heads, MLP 4096, vocab 30522,
512 tokens).
"""

import torch
from transformers import ElectraConfig, ElectraForPreTraining

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, embedding_size=32, num_attention_heads=4,
                 intermediate_size=128, vocab_size=256, max_position_embeddings=64),
    "full": dict(num_hidden_layers=24, hidden_size=1024, embedding_size=1024, num_attention_heads=16,
                 intermediate_size=4096, vocab_size=30522, max_position_embeddings=512),
}
SIZE = "tiny"
CONFIG = ElectraConfig(**SIZES[SIZE], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return ElectraForPreTraining(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    replaced = torch.randint(0, 2, (micro_batch_size, SEQ_LEN))  # 1 where the generator replaced the token
    return {"input_ids": ids, "labels": replaced}


def loss_fn(output, inputs):
    return output.loss
