"""HF ModernBertForMaskedLM: alternating global/local attention picked by layer index."""
import torch
from transformers import ModernBertConfig, ModernBertForMaskedLM

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=256,
                 max_position_embeddings=64, local_attention=8, global_attn_every_n_layers=2),
    "full": dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28, num_attention_heads=16,
                 vocab_size=50368, max_position_embeddings=8192, local_attention=128, global_attn_every_n_layers=3),
}
SIZE = "tiny"
CONFIG = ModernBertConfig(**SIZES[SIZE], pad_token_id=0)
SEQ_LEN = 32 if SIZE == "tiny" else 1024


def build_model():
    return ModernBertForMaskedLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(1, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
