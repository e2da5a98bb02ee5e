"""The reasons a dimension is not offered are true for models whose blocks differ or whose experts
autopar cannot shard (tiny configs of the zoo's files): HF Qwen3-Next's blocks (gated delta-net and
attention, experts in every one) shard those experts under ep, and neither it nor any other chain
is told its token inputs are wrong when cp is refused; HF Switch Transformers, whose router picks
among experts in an ``nn.ModuleDict``, is not told it has no experts."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from autopar.modelfile import load_model_file  # noqa: E402
from autopar.spec import model_spec  # noqa: E402

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"


def test_a_chain_whose_every_block_holds_experts() -> None:
    spec = model_spec(load_model_file(ZOO / "hf_qwen3_next.py"))
    # gated delta-net and attention layers, the same experts in every one: ep shards each unit's
    assert spec.moe_units == spec.chain.units and spec.support["ep"] is None
    assert spec.support["cp"].startswith("the blocks differ (a chain of 4 units)")


def test_experts_in_a_module_dict_are_named_as_such() -> None:
    spec = model_spec(load_model_file(ZOO / "hf_switch_transformers.py"))
    assert spec.routed
    assert spec.support["ep"].startswith("a router chooses among experts")
