"""Hugging Face CodeGenForCausalLM trained through ``labels``: attention and MLP in parallel off one
LayerNorm (GPT-J's block), one fused ``qkv_proj`` whose output the attention reshapes into ``mp_num = 4``
groups, each holding a slice of q, v and k (the layout of the TPU shards it was trained on), partial
rotary over the first ``rotary_dim`` channels of each head, an untied head with a bias.

Full size: CodeGen-6B-mono (33 layers, hidden 4096, 16 heads of 256, rotary 64, vocab 51200, 2048 tokens).
"""

import torch
from transformers import CodeGenConfig, CodeGenForCausalLM

SIZES = {
    "tiny": dict(n_layer=4, n_embd=64, n_head=4, rotary_dim=8, vocab_size=256, n_positions=64),
    "full": dict(n_layer=33, n_embd=4096, n_head=16, rotary_dim=64, vocab_size=51200, n_positions=2048),
}
SIZE = "tiny"
CONFIG = CodeGenConfig(**SIZES[SIZE], n_ctx=SIZES[SIZE]["n_positions"], resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                       use_cache=False)
SEQ_LEN = CONFIG.n_positions


def build_model():
    return CodeGenForCausalLM(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_fn(output, inputs):
    return output.loss
