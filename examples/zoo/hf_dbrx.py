"""Hugging Face DbrxForCausalLM: every expert's weights packed along the rows of three 2-D
parameters (``w1``, ``v1``, ``w2`` of (experts x ffn, hidden), viewed per expert inside the expert
loop), under a router module holding an ``nn.Linear`` (``router.layer``) and top-k set in a nested
``ffn_config``; fused ``Wqkv`` with clipping, blocks in ``transformer.blocks``. ``use_cache=False``,
next-token loss on ``output.logits``.

Full size: DBRX (40 layers, d_model 6144, 48 heads / 8 KV heads, 16 experts of 10752, top-4,
vocab 100352), at 4096 tokens.
"""

import torch
import torch.nn.functional as F
from transformers import DbrxConfig, DbrxForCausalLM

SIZES = {
    "tiny": dict(n_layers=4, d_model=64, n_heads=4, vocab_size=256, max_seq_len=32,
                 attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=500000.0),
                 ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2)),
    "full": dict(n_layers=40, d_model=6144, n_heads=48, vocab_size=100352, max_seq_len=4096,
                 attn_config=dict(kv_n_heads=8, clip_qkv=8.0, rope_theta=500000.0),
                 ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16, moe_top_k=4)),
}
SIZE = "tiny"
CONFIG = DbrxConfig(**SIZES[SIZE], use_cache=False)
SEQ_LEN = CONFIG.max_seq_len


def build_model():
    return DbrxForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    return torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[:, 1:].reshape(-1))
