"""Hugging Face DeepseekV3ForCausalLM: one ``model.layers`` ModuleList whose first
``first_k_dense_replace`` layers are dense and the rest mixture-of-experts (routed experts with
group-limited top-k, a shared expert), so its blocks differ in structure; multi-head latent
attention (low-rank q and kv, split rotary/non-rotary head dims). Dict of ``input_ids`` and
``labels``, ``output.loss``.

Full size: DeepSeek-V2-Lite's shape (27 layers, the first dense; hidden 2048, 16 heads, kv rank 512,
64 routed experts of 1408 (top 6) plus 2 shared, dense MLP 10944, vocab 102400).
"""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

SIZES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                 n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                 kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, vocab_size=256,
                 max_position_embeddings=32),
    "full": dict(num_hidden_layers=27, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                 n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
                 n_group=1, topk_group=1, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                 kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 vocab_size=102400, max_position_embeddings=4096),
}
SIZE = "tiny"
CONFIG = DeepseekV3Config(**SIZES[SIZE], use_cache=False, attention_dropout=0.0)
SEQ_LEN = 32 if SIZE == "tiny" else 2048


def build_model():
    return DeepseekV3ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
