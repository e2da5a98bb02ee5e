"""Hugging Face BartForConditionalGeneration trained through ``labels`` only, as seq2seq trainers do:
the model builds its decoder inputs by shifting the labels right inside its forward; learned positions
with BART's offset of 2, post-LN blocks, a LayerNorm on the embeddings of both stacks, the encoder and
decoder sharing one token embedding with the LM head, a ``final_logits_bias`` buffer.

Full size: BART-large (12 + 12 layers, d_model 1024, 16 heads of 64, FFN 4096, vocab 50265, 1024 tokens).
"""

import torch
from transformers import BartConfig, BartForConditionalGeneration

SIZES = {
    "tiny": dict(encoder_layers=2, decoder_layers=2, d_model=64, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256,
                 max_position_embeddings=64),
    "full": dict(encoder_layers=12, decoder_layers=12, d_model=1024, encoder_attention_heads=16,
                 decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=50265,
                 max_position_embeddings=1024),
}
SIZE = "tiny"
CONFIG = BartConfig(**SIZES[SIZE], dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False)
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return BartForConditionalGeneration(CONFIG)


def example_inputs(micro_batch_size):
    # token ids above the special ones (pad 1, bos 0, eos 2): no padding anywhere
    src = torch.randint(3, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    tgt = torch.randint(3, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": src, "labels": tgt}


def loss_fn(output, inputs):
    return output.loss
