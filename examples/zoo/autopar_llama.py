"""autopar's own reference Llama-3 (RMSNorm, SwiGLU, RoPE, GQA) in a model file without a ``tp_plan``
line or ``pipeline_blocks``.

Full size: Llama-3 8B (32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336, vocab 128256, 8192 tokens).
"""

from autopar.models.gpt import example_tokens, next_token_loss
from autopar.models.llama import Llama, LlamaConfig

SIZES = {
    "tiny": dict(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                 seq_len=32, vocab_size=256),
    "full": dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                 seq_len=8192, vocab_size=128256),
}
SIZE = "tiny"
CONFIG = LlamaConfig(**SIZES[SIZE])
SEQ_LEN = CONFIG.seq_len


def build_model():
    return Llama(CONFIG)


def example_inputs(micro_batch_size):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
