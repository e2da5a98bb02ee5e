"""tiny_gpt with a loss_fn that cannot run on vocab-sharded DTensor logits: ``torch.gather`` with a
plain index tensor. Still mean next-token cross-entropy; under tp the executor must fall back to
all-gathered logits (executor/tensor_parallel.VocabParallelLoss) and match the reference."""

import torch

from autopar.models.gpt import GPT, GPT_TP_PLAN, GPTConfig, example_tokens

CONFIG = GPTConfig(num_layers=4, hidden_size=64, num_heads=4, seq_len=32, vocab_size=128, dropout=0.0)
SEQ_LEN = CONFIG.seq_len
tp_plan = GPT_TP_PLAN
pipeline_blocks = "layers"


def build_model():
    return GPT(CONFIG)


def example_inputs(micro_batch_size: int):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    logp = torch.log_softmax(output[:, :-1].float(), dim=-1)
    return -torch.gather(logp, -1, inputs[:, 1:].unsqueeze(-1)).mean()
