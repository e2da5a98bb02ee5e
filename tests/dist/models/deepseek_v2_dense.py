"""Hugging Face DeepseekV2ForCausalLM, every layer dense, queries without a low-rank stage
(``q_lora_rank=None``, DeepSeek-V2-Lite's attention): the column-parallel ``q_proj`` and the replicated
``kv_a_proj_with_mqa`` both read the attention's input, so under sequence parallelism the gathered
input's gradient adds a colwise layer's share to the replicated layer's whole gradient. Identical
blocks: one block list (not a chain). Dict of ``input_ids`` and ``labels``, ``output.loss``."""

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

CONFIG = DeepseekV2Config(num_hidden_layers=4, first_k_dense_replace=4, hidden_size=64, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, vocab_size=256,
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          max_position_embeddings=32, use_cache=False, attention_dropout=0.0)
SEQ_LEN = 32


def build_model():
    return DeepseekV2ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
