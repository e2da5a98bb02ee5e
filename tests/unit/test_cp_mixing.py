"""Context parallelism is offered only where nothing but the attention mixes positions
(spec/cp_check.py): a Hugging Face decoder as is keeps cp; the same decoder with a token shift in its
MLP (RWKV-style; Falcon-H1's Mamba branch beside the attention does the same) is refused, with the
reason, although its attention alone is what the executor makes context-parallel."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from autopar.modelfile import load_model_file  # noqa: E402
from autopar.spec import model_spec  # noqa: E402

SOURCE = '''
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, use_cache=False,
                     attn_implementation="eager")
SEQ_LEN = 16
SHIFT = {shift}


class Shifted(nn.Module):
    """The MLP fed each position's input mixed with the previous position's (a token shift)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        return self.mlp(0.5 * (x + prev))


def build_model():
    model = LlamaForCausalLM(CONFIG)
    if SHIFT:
        for layer in model.model.layers:
            layer.mlp = Shifted(layer.mlp)
    return model


def example_inputs(micro_batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {{"input_ids": ids, "labels": ids.clone()}}


def loss_fn(output, inputs):
    return output.loss
'''


def _spec(tmp_path: Path, shift: bool):
    path = tmp_path / f"llama_shift_{shift}.py"
    path.write_text(SOURCE.format(shift=shift))
    return model_spec(load_model_file(path))


def test_a_plain_decoder_keeps_context_parallelism(tmp_path: Path) -> None:
    assert _spec(tmp_path, False).support["cp"] is None


def test_a_token_shift_beside_the_attention_refuses_it(tmp_path: Path) -> None:
    why = _spec(tmp_path, True).support["cp"]
    assert why is not None and "mixes positions outside its attention (self_attn)" in why


@pytest.mark.parametrize("max_shared", [300_000_000, 1500], ids=["shared-values", "one-value"])
def test_large_weights_keep_both_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_shared: int) -> None:
    # a full-size block's MLP (over _MAX_DENSE elements) views one shared buffer of random values, or
    # above _MAX_SHARED holds one broadcast value instead of storage
    import autopar.spec as spec_pkg
    from autopar.spec import cp_check

    monkeypatch.setattr(cp_check, "_MAX_DENSE", 1500)  # the 32 x 64 MLP weights, not the 32 x 32 projections
    monkeypatch.setattr(cp_check, "_MAX_SHARED", max_shared)
    spec_pkg._CACHE.clear()
    assert _spec(tmp_path, False).support["cp"] is None
    assert "mixes positions outside its attention" in _spec(tmp_path, True).support["cp"]


def test_large_weights_view_one_dense_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A linear layer reading a broadcast weight copies it on every call: weights over _MAX_DENSE are
    contiguous views of one buffer the size of the largest; small ones keep values of their own."""
    import torch
    from torch import nn

    from autopar.spec import cp_check

    monkeypatch.setattr(cp_check, "_MAX_DENSE", 1500)
    with torch.device("meta"):
        block = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 32))
    real = cp_check._materialise(block, torch.Generator().manual_seed(0))
    big = [real[0].weight, real[1].weight]
    assert all(w.is_contiguous() and w.device.type == "cpu" for w in big)
    assert big[0].untyped_storage().data_ptr() == big[1].untyped_storage().data_ptr()
    assert real[2].weight.untyped_storage().data_ptr() != big[0].untyped_storage().data_ptr()
    assert big[0].unique().numel() > 1000  # random values, not one
