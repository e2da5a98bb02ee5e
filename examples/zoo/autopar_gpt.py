"""autopar's own reference GPT (Megatron architecture) in a model file that declares nothing: no
``tp_plan`` line, no ``pipeline_blocks``. The model carries what autopar needs to know itself.

Full size: GPT-3 13B (40 layers, hidden 5120, 40 heads, vocab 51200, 2048 tokens).
"""

from autopar.models.gpt import GPT, GPTConfig, example_tokens, next_token_loss

SIZES = {
    "tiny": dict(num_layers=4, hidden_size=64, num_heads=4, seq_len=32, vocab_size=256),
    "full": dict(num_layers=40, hidden_size=5120, num_heads=40, seq_len=2048, vocab_size=51200),
}
SIZE = "tiny"
CONFIG = GPTConfig(**SIZES[SIZE], dropout=0.0)
SEQ_LEN = CONFIG.seq_len


def build_model():
    return GPT(CONFIG)


def example_inputs(micro_batch_size):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
