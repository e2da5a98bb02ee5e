"""A replicated layer whose last output features feed every tp rank's sharded heads directly
(multi-head latent attention's shared rotary key: Hugging Face's ``mla_kv_a_proj`` style) gets its
gradient summed over the tp ranks (TPPlan.grad_sums), read from the model's carried plan and
config; without the width, tensor parallelism is refused rather than trained on partial
gradients. (That the sum makes tp2 train like one rank: tests/dist/test_expert_parallel.py's
hf-deepseek-v3 tp2 x dp2 x ep2 case, which compares step-1 gradients.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

from autopar.spec.tp_plan import TPPlan, grad_sums_of

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import zoo_lib  # noqa: E402


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kv_a_proj_with_mqa = nn.Linear(16, 12)
        self.kv_b_proj = nn.Linear(8, 32)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attn()


PLAN = {"layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj", "layers.*.self_attn.kv_b_proj": "colwise"}


def test_the_width_comes_from_the_config() -> None:
    sums, missing = grad_sums_of(PLAN, _Block(), "layers", ("",), SimpleNamespace(qk_rope_head_dim=4))
    assert sums == {"self_attn.kv_a_proj_with_mqa": 4} and missing == []
    sums, missing = grad_sums_of(PLAN, _Block(), "layers", ("",), SimpleNamespace())
    assert sums == {} and missing == ["self_attn.kv_a_proj_with_mqa (mla_kv_a_proj: config.qk_rope_head_dim)"]


def test_a_summed_layer_is_replicated_and_counts_features() -> None:
    with pytest.raises(ValueError, match="replicated layer"):
        TPPlan(styles={"a": "colwise", "b": "rowwise"}, source="model", grad_sums={"a": 4})
    with pytest.raises(ValueError, match="count"):
        TPPlan(styles={}, source="model", grad_sums={"a": 0})


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_deepseek_latent_attention_sums_its_shared_rotary_key(tmp_path) -> None:
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    mf = load_model_file(zoo_lib.with_size(zoo_lib.zoo_models(["hf_deepseek_v3"])[0].path, "tiny", tmp_path))
    spec = model_spec(mf)
    for kind in spec.kind_tp:  # the dense first layer and the MoE layers alike
        assert dict(kind.plan.grad_sums) == {"self_attn.kv_a_proj_with_mqa": 8}  # qk_rope_head_dim
        assert not any("kv_a_proj_with_mqa" in note for note in kind.plan.dropped)
    assert spec.support["tp"] is None
