"""A tiny valid GPT with 12 heads (hidden 192): tensor parallelism of 8 does not divide its heads."""

from autopar.models.gpt import GPT, GPT_TP_PLAN, GPTConfig, example_tokens, next_token_loss

CONFIG = GPTConfig(num_layers=4, hidden_size=192, num_heads=12, seq_len=64, vocab_size=256)
SEQ_LEN = CONFIG.seq_len
tp_plan = GPT_TP_PLAN
pipeline_blocks = "layers"


def build_model():
    return GPT(CONFIG)


def example_inputs(micro_batch_size: int):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
