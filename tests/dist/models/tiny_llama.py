"""Tiny Llama (GQA: 4 heads, 2 KV heads) for the distributed equivalence tests."""

from autopar.models.gpt import example_tokens, next_token_loss
from autopar.models.llama import LLAMA_TP_PLAN, Llama, LlamaConfig

CONFIG = LlamaConfig(
    num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, seq_len=32, vocab_size=128
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
