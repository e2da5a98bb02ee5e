"""Hugging Face Qwen2ForCausalLM fed SFT-style batches the HF-Trainer way: ``{"input_ids", "labels"}``
with labels -100 on each row's prompt (a prefix of varying length, one row wholly a prompt's first
half) and the model's own loss (``output.loss``). For context parallelism over dict batches
(tests/dist/test_cp_hf_dict.py): the targets' ignored positions fall unevenly across the cp shards.
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

CONFIG = Qwen2Config(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, use_cache=False,
                     attn_implementation="eager")
SEQ_LEN = CONFIG.max_position_embeddings


def build_model():
    return Qwen2ForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def dataset(global_batch_size, step, seed):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (global_batch_size, SEQ_LEN), generator=g)
    labels = ids.clone()
    prompt = torch.randint(1, SEQ_LEN - 4, (global_batch_size,), generator=g)
    prompt[0] = SEQ_LEN * 3 // 4  # the first row: a long prompt, its targets all in the last shard chunks
    for row, n in enumerate(prompt.tolist()):
        labels[row, :n] = -100
    return {"input_ids": ids, "labels": labels}


def loss_fn(output, inputs):
    return output.loss
