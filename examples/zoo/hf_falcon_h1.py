"""Hugging Face FalconH1ForCausalLM trained through ``labels``: a hybrid in which every layer runs a
Mamba-2 mixer and attention side by side on the same normed input (parallel hybrid, not interleaved),
then a SwiGLU MLP; the mixer's reference chunked scan on CPU and meta, and muP multipliers on the
embeddings, the projections and the logits.

Full size: Falcon-H1-7B shape (44 layers, hidden 3072, 12 heads / 2 KV heads of 128, MLP 12288, Mamba
mixer of 24 heads of 128 with state 256 and one group, vocab 130048; planned at 4096 tokens).
"""

import torch
from transformers import FalconH1Config, FalconH1ForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                 mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16, vocab_size=256,
                 max_position_embeddings=64),
    "full": dict(num_hidden_layers=44, hidden_size=3072, intermediate_size=12288, num_attention_heads=12,
                 num_key_value_heads=2, head_dim=128, mamba_d_ssm=3072, mamba_n_heads=24, mamba_d_head=128,
                 mamba_d_state=256, mamba_n_groups=1, mamba_chunk_size=256, vocab_size=130048,
                 max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = FalconH1Config(**SIZES[SIZE], use_cache=False, attn_implementation="eager")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return FalconH1ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
