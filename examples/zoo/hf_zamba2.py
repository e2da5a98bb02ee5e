"""Hugging Face Zamba2ForCausalLM trained through ``labels``: a stack of Mamba-2 layers in which every
``hybrid`` layer first runs a *shared* transformer block (attention + MLP whose weights are reused at each
depth that calls it, ``num_mem_blocks`` of them in turn) on the concatenation of the hidden state and the
original embeddings, projects it back through the layer's own linear, then its own Mamba-2 mixer. One
``nn.Module`` called at several depths, the reference chunked scan on CPU and meta.

Full size: Zamba2-2.7B (54 layers, 9 of them hybrid, two shared blocks in turn, hidden 2560, 32 heads,
MLP 10240, Mamba-2 with 80 heads and state 64, vocab 32000; planned at 4096 tokens).
"""

import torch
from transformers import Zamba2Config, Zamba2ForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], hidden_size=64,
                 num_attention_heads=4, intermediate_size=128, num_mem_blocks=1, n_mamba_heads=4,
                 mamba_d_state=16, chunk_size=16, vocab_size=256, max_position_embeddings=64),
    "full": dict(num_hidden_layers=54, hidden_size=2560, num_attention_heads=32, intermediate_size=10240,
                 num_mem_blocks=2, n_mamba_heads=80, mamba_d_state=64, chunk_size=256, vocab_size=32000,
                 max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = Zamba2Config(**SIZES[SIZE], use_cache=False, attn_implementation="eager")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Zamba2ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
