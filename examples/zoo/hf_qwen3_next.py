"""Hugging Face Qwen3NextForCausalLM trained through ``labels``: a hybrid of gated delta-net layers (linear
attention whose reference kernel loops over chunks of the sequence, a causal depthwise conv before it) and
gated full attention on every fourth layer, with a top-k mixture of many small experts and a gated shared
expert on every layer.

Full size: Qwen3-Next-80B-A3B (48 layers, hidden 2048, attention 16 heads / 2 KV heads of 256, delta-net
16 key / 32 value heads of 128, 512 experts of 512 top-10 plus a shared expert of 512, vocab 151936;
planned at 4096 tokens).
"""

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                 vocab_size=256, max_position_embeddings=64),
    "full": dict(num_hidden_layers=48, hidden_size=2048, intermediate_size=5120, num_attention_heads=16,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                 num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                 vocab_size=151936, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = Qwen3NextConfig(**SIZES[SIZE], use_cache=False, attn_implementation="eager")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Qwen3NextForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
