"""Llama-3 70B (Meta 2024): 80 layers, hidden 8192, 64 heads / 8 KV heads, SwiGLU 28672, vocab 128256."""

from autopar.models.gpt import example_tokens, next_token_loss
from autopar.models.llama import LLAMA_TP_PLAN, Llama, LlamaConfig

CONFIG = LlamaConfig(
    num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
    ffn_hidden_size=28672, seq_len=8192, vocab_size=128256,
)
SEQ_LEN = CONFIG.seq_len
tp_plan = LLAMA_TP_PLAN
pipeline_blocks = "layers"


def build_model():
    return Llama(CONFIG)


def example_inputs(micro_batch_size: int):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
