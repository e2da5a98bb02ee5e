"""autopar's Llama wrapped the way training frameworks wrap a network: it sits in an attribute named
``model`` (``Wrapper.model.layers[i]``), so every parameter name starts with ``model.`` -- the name
the executor must not mistake for a wrapper's prefix. Carries an attention core and ``positions=``,
so every dimension (tp + sp, cp, pp, selective recompute) is offered on it.
"""

from torch import nn

from autopar.models.gpt import example_tokens, next_token_loss
from autopar.models.llama import LLAMA_TP_PLAN, Llama, LlamaConfig

CONFIG = LlamaConfig(
    num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, seq_len=32, vocab_size=128
)
SEQ_LEN = CONFIG.seq_len
tp_plan = LLAMA_TP_PLAN  # block-relative


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Llama(CONFIG)

    def forward(self, tokens, positions=None):
        return self.model(tokens, positions=positions)


def build_model():
    return Wrapper()


def example_inputs(micro_batch_size: int):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
