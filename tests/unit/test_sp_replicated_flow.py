"""The data flow of a tensor-parallel block's replicated parameters (spec/tp_replicated.py): which
compute on a tp shard (gradient summed over tp), which on whole tensors (the full gradient on every
rank, never summed), and which would train on a partial gradient nothing fixes (refused). Plain-torch
blocks shaped like multi-head latent attention, a per-head q norm and their faults; HF DeepSeek-V3's
SP offered (the whole run against one rank: tests/dist/test_mla_sp.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.spec.sp_check import sp_check
from autopar.spec.tp_plan import ReplicatedFlow
from autopar.spec.tp_replicated import replicated_flow

REPO = Path(__file__).resolve().parents[2]
HEADS, DIM, RANK, ROPE = 4, 8, 16, 4


class _Attn(nn.Module):
    """q through a replicated low-rank stage and its norm, then colwise (MLA's q_a_proj -> q_a_layernorm
    -> q_b_proj); a norm of each head's q; ``rope``: a replicated layer's features every head reads
    directly (MLA's shared rotary key) -- unless ``head_linear``, a replicated Linear applied per head."""

    def __init__(self, hidden: int, *, rope: bool = False, head_linear: bool = False) -> None:
        super().__init__()
        self.q_a = nn.Linear(hidden, RANK, bias=False)
        self.q_a_norm = nn.RMSNorm(RANK)
        self.q_b = nn.Linear(RANK, HEADS * DIM, bias=False)
        self.q_norm = nn.RMSNorm(DIM)
        self.v = nn.Linear(hidden, HEADS * (DIM + ROPE if rope else DIM), bias=False)
        self.k_rope = nn.Linear(hidden, ROPE, bias=False) if rope else None
        self.per_head = nn.Linear(DIM, DIM, bias=False) if head_linear else None
        self.o = nn.Linear(HEADS * (DIM + ROPE if rope else DIM), hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_b(self.q_a_norm(self.q_a(x))).view(b, s, -1, DIM))
        if self.per_head is not None:
            q = self.per_head(q)
        v = self.v(x).view(b, s, q.shape[2], -1)
        if self.k_rope is not None:
            q = torch.cat([q, self.k_rope(x).view(b, s, 1, ROPE).expand(b, s, q.shape[2], ROPE)], dim=-1)
        return self.o((q * v).reshape(b, s, -1))


class _Block(nn.Module):
    def __init__(self, hidden: int = 16, **kw: bool) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.attn = _Attn(hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


STYLES = {"attn.q_b": "colwise", "attn.v": "colwise", "attn.o": "rowwise"}


def _flow(block: nn.Module, grad_sums: dict[str, int] | None = None) -> ReplicatedFlow:
    x = torch.randn(2, 8, 16, device="meta")
    flow = replicated_flow(block.to("meta"), STYLES, grad_sums or {}, lambda: block(x))
    assert flow is not None
    return flow


def test_whole_input_layers_are_not_summed_and_head_norms_are() -> None:
    flow = _flow(_Block())
    # without SP the block's input is whole on every rank: only the per-head q norm sees a shard
    assert flow.on_shard == ("attn.q_norm.weight",)
    # under SP the residual norm runs on the sequence shard too; the low-rank q stage still gets the
    # all-gathered input whole, and the colwise q_b sums its heads' shares of their gradient
    assert flow.on_shard_sp == ("norm.weight", "attn.q_norm.weight")
    assert flow.shard_norms(False) == ("attn.q_norm",) and flow.shard_norms(True) == ("norm", "attn.q_norm")
    assert flow.reason(False) is None and flow.reason(True) is None


def test_a_replicated_layer_read_by_every_head_directly_needs_its_sum() -> None:
    flow = _flow(_Block(rope=True))
    for sp in (False, True):  # each rank's heads' share of k_rope's gradient, and nothing sums it
        assert flow.reason(sp).startswith("attn.k_rope.weight computes a tensor that meets each tp rank's shard")
    flow = _flow(_Block(rope=True), grad_sums={"attn.k_rope": ROPE})  # the executor sums it at the output
    assert flow.reason(False) is None and flow.reason(True) is None
    assert "attn.k_rope.weight" not in flow.on_shard + flow.on_shard_sp


def test_a_replicated_layer_on_the_heads_is_refused() -> None:
    flow = _flow(_Block(head_linear=True))
    assert flow.not_norms == ("attn.per_head.weight",)
    assert flow.reason(False).startswith("attn.per_head.weight is in neither a tensor-parallel layer nor a norm")
    assert flow.reason(True).startswith("attn.per_head.weight is in neither a tensor-parallel layer nor a norm")


def test_sp_check_runs_the_low_rank_stage_whole_and_checks_its_numbers() -> None:
    block = _Block()
    x = torch.randn(2, 8, 16, device="meta")
    flow = _flow(block)
    why, _ = sp_check(block, STYLES, {}, (), lambda: block(x), flow=flow)
    assert why is None
    # without the data flow every parameter outside the plan's layers and norms is refused
    why, _ = sp_check(block, STYLES, {}, (), lambda: block(x))
    assert why is not None and why.startswith("attn.q_a.weight is in neither")
    # the faults above, refused by the SP check as by the tp predicate
    rope = _Block(rope=True)
    why, _ = sp_check(rope, STYLES, {}, (), lambda: rope(x), flow=_flow(rope))
    assert why is not None and "attn.k_rope.weight" in why


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_deepseek_latent_attention_is_offered_sequence_parallelism(tmp_path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import zoo_lib

    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    mf = load_model_file(zoo_lib.with_size(zoo_lib.zoo_models(["hf_deepseek_v3"])[0].path, "tiny", tmp_path))
    spec = model_spec(mf)
    assert spec.support["tp"] is None and spec.support["sp"] is None
    for kind in spec.kind_tp:
        flow = kind.plan.flow
        whole = [n for n in flow.on_shard + flow.on_shard_sp if n.startswith("self_attn.")]
        assert whole == [], whole  # q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm: full gradients
        assert set(flow.shard_norms(True)) >= {"input_layernorm", "post_attention_layernorm"}
        assert flow.shard_norms(False) == ()
