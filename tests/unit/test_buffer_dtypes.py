"""Floating buffers in the dtype the model's code gives them when it trains in 16 bits
(executor/parallel/buffer_dtypes.py): under FSDP2's mixed precision the parameters compute in bf16
while buffers stayed fp32, and a model written for one dtype -- HF MiniMax's lightning attention
multiplies bf16 scores by an fp32 decay buffer, then hands the product to a matmul with bf16 values
-- failed at its first step, on a GPU as on the rehearsal's fake tensors."""

from __future__ import annotations

import torch

from autopar.executor.parallel.buffer_dtypes import built_dtypes, cast_buffers
from autopar.modelfile import load_model_file

MODEL = '''
import torch
from torch import nn

SEQ_LEN = 16


class Decayed(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        # made without naming a dtype (the default dtype's), as MiniMax's decays are
        self.register_buffer("decay", torch.exp(-torch.arange(SEQ_LEN)[:, None] / 4.0 * torch.ones(SEQ_LEN)))
        # made in fp32 on purpose, as a rotary inv_freq is
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) * self.decay.tril()
        return x + self.out(scores @ v)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([Decayed(16) for _ in range(2)])
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randint(0, 32, (micro_batch_size, SEQ_LEN))


def loss_fn(output, inputs):
    return torch.nn.functional.cross_entropy(output.flatten(0, 1).float(), inputs.flatten())
'''


def _model(tmp_path):
    path = tmp_path / "decayed.py"
    path.write_text(MODEL, encoding="utf-8")
    return path


def test_buffers_take_the_dtype_the_code_gives_them_under_the_training_dtype(tmp_path) -> None:
    mf = load_model_file(str(_model(tmp_path)))
    dtypes = built_dtypes(mf, torch.bfloat16)
    assert dtypes["layers.0.decay"] == torch.bfloat16 and dtypes["layers.0.inv_freq"] == torch.float32
    assert torch.get_default_dtype() == torch.float32  # restored
    model = mf.build("cpu")
    cast = cast_buffers(model, dtypes, lambda name: name)
    assert sorted(cast) == ["layers.0.decay", "layers.1.decay"]
    assert model.layers[1].decay.dtype == torch.bfloat16 and model.layers[1].inv_freq.dtype == torch.float32


def test_a_bf16_fsdp2_plan_of_such_a_model_rehearses(tmp_path) -> None:
    from autopar import api
    from autopar.plan import plan_from_dict

    path = _model(tmp_path)
    plan = plan_from_dict({
        "version": 1, "model": {"file": str(path), "num_blocks": 2},
        "cluster": {"profile": "h100-80g", "num_gpus": 2, "gpus_per_node": 8},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "dtype": "bf16",
                     "optimizer": "adam"},
        "parallel": {"dp": 2, "tp": 1, "pp": 1, "zero": 1}})
    result = api.rehearsal(plan, str(path), ranks=[0], workers=1, use_cache=False)  # failed: Float vs BFloat16
    assert result.ranks[0].peak_bytes > 0
