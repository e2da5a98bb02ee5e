"""GPT-3 175B (Brown et al. 2020) in the Megatron architecture: 96 layers, hidden 12288, 96 heads."""

from autopar.models.gpt import GPT, GPT_TP_PLAN, GPTConfig, example_tokens, next_token_loss

CONFIG = GPTConfig(num_layers=96, hidden_size=12288, num_heads=96, seq_len=2048, vocab_size=51200)
SEQ_LEN = CONFIG.seq_len
tp_plan = GPT_TP_PLAN
pipeline_blocks = "layers"


def build_model():
    return GPT(CONFIG)


def example_inputs(micro_batch_size: int):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
