"""A small GPT (8 layers, hidden 256) that trains on CPU: the walk-through and test model."""

from autopar.models.gpt import GPT, GPT_TP_PLAN, GPTConfig, example_tokens, next_token_loss

CONFIG = GPTConfig(num_layers=8, hidden_size=256, num_heads=8, seq_len=128, vocab_size=1024, dropout=0.0)
SEQ_LEN = CONFIG.seq_len
tp_plan = GPT_TP_PLAN
pipeline_blocks = "layers"


def build_model():
    return GPT(CONFIG)


def example_inputs(micro_batch_size: int):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
