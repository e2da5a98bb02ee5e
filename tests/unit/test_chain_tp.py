"""TP plans per unit kind of a chain of differing blocks (spec/chain_tp.py): each kind resolves its
own plan by the block precedence (declared, carried, inferred), and the first kind without one is
named in the tp refusal."""

from __future__ import annotations

from pathlib import Path

from autopar.modelfile import load_model_file
from autopar.spec import model_spec

MIXED = Path(__file__).resolve().parents[1] / "dist" / "models" / "mixed_blocks.py"


# the fixture's attention reshapes by the global head count; read off the tensor, it runs on a
# tp rank's heads (the data-flow check then keeps the attention pair)
_HEADS_FIXED = "view(b, s, 3, HEADS, DIM // HEADS)"
_HEADS_LOCAL = "view(b, s, 3, -1, DIM // HEADS)"


def _spec(tmp_path: Path, extra: str = "", *, local_heads: bool = True):
    src = MIXED.read_text()
    assert _HEADS_FIXED in src and "reshape(b, s, DIM)" in src
    if local_heads:
        src = src.replace(_HEADS_FIXED, _HEADS_LOCAL).replace("reshape(b, s, DIM)", "reshape(b, s, -1)")
    path = tmp_path / "mixed.py"
    path.write_text(src + extra)
    return model_spec(load_model_file(path))


def test_each_kind_of_a_mixed_block_list_infers_its_own_plan(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    assert spec.chain.kinds == (0, 0, 2, 2) and spec.tp.styles == {}
    dense, moe = spec.kind_tp
    assert (dense.unit, dense.count, moe.unit, moe.count) == ("layers.0", 2, "layers.2", 2)
    assert dense.plan.source == moe.plan.source == "inferred"
    assert dict(dense.plan.styles) == {"attn.qkv": "colwise", "attn.out": "rowwise", "mlp.up": "colwise",
                                       "mlp.down": "rowwise"}
    # the experts' grouped weights are no Linear pair: only the attention of the MoE kind is planned
    assert dict(moe.plan.styles) == {"attn.qkv": "colwise", "attn.out": "rowwise"}


def test_a_declared_plan_applies_to_each_kind_what_it_names_there(tmp_path: Path) -> None:
    declared = ('\ntp_plan = {"layers.*.attn.qkv": "colwise", "layers.*.attn.out": "rowwise", '
                '"mlp.up": "colwise", "mlp.down": "rowwise"}\n')
    dense, moe = _spec(tmp_path, declared).kind_tp
    assert dense.plan.source == moe.plan.source == "declared"
    assert set(dense.plan.styles) == {"attn.qkv", "attn.out", "mlp.up", "mlp.down"}
    assert set(moe.plan.styles) == {"attn.qkv", "attn.out"}


def test_the_refusal_names_the_first_kind_without_a_plan(tmp_path: Path) -> None:
    # heads by the global count: the dense kind keeps its MLP pair, the MoE kind has no pair left
    spec = _spec(tmp_path, local_heads=False)
    dense, moe = spec.kind_tp
    assert dict(dense.plan.styles) == {"mlp.up": "colwise", "mlp.down": "rowwise"} and not moe.plan.styles
    why = spec.support_reason("tp")
    assert why is not None and "unit kind layers.2 (2 of the chain's units) has no tp plan" in why
    assert "\n" not in why
