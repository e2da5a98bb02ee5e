"""FSDP2's unit gradients in the step's temporaries (graph/live.py's Tg; cost.zero.holds_unit_grads):
a unit's parameter gradients live, unsharded in the training dtype, from the op that makes them to
the unit's post-backward; the root unit's (head, tied or not) to the end of the stage's backward.
DDP and one unwrapped rank count gradients as model states, so their price is T (T' where the
activations are the model file's own), as before; ZeRO-3 holds them beside its two gathered blocks."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autopar.cluster import load_cluster
from autopar.cost.estimate import config_from_plan
from autopar.cost.stage import build_terms
from autopar.cost.zero import holds_unit_grads
from autopar.graph.live import live_peaks
from autopar.models.gpt import GPTConfig
from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training
from autopar.reference import gpt_graph, gpt_model_path

W, V, TOKENS = 64, 1000, 32
MIB = 2**20


class _Tiny(nn.Module):
    """Embedding, one two-Linear block, a head tied to the embedding or not (bf16 on meta)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, W)
        self.fc1, self.fc2 = nn.Linear(W, 4 * W, bias=False), nn.Linear(4 * W, W, bias=False)
        self.head = None if tied else nn.Linear(W, V, bias=False)

    def forward(self, x: torch.Tensor, set_region) -> torch.Tensor:  # noqa: ANN001
        h = self.emb(x)
        set_region("block")
        h.register_hook(lambda g: set_region("bwd:pre"))
        y = self.fc2(torch.relu(self.fc1(h)))
        set_region("post")
        y.register_hook(lambda g: set_region("bwd:block"))
        return y @ (self.emb.weight if self.head is None else self.head.weight).t()


def _peaks(tied: bool):  # noqa: ANN202
    with torch.device("meta"):
        model = _Tiny(tied).bfloat16()
    x = torch.zeros(TOKENS, dtype=torch.long, device="meta")

    def step(set_region) -> None:  # noqa: ANN001
        set_region("pre")
        out = model(x, set_region)
        set_region("loss")
        out.register_hook(lambda g: set_region("bwd:post"))
        loss = out.float().mean()
        del out
        set_region("bwd:loss")
        loss.backward()

    return live_peaks(step, list(model.parameters()))


def test_a_blocks_gradients_count_in_its_backward_and_are_dropped_after() -> None:
    """Tg's gradient part in the block's backward is its weights' gradients (bf16), the first
    one made (fc2's) at least; T leaves gradients out; the embedding's backward meets none of the
    block's (its unit has folded them away)."""
    live = _peaks(tied=False)
    t, tg = live.temps, live.with_grads
    fc_grad = W * 4 * W * 2  # one of fc1 / fc2, bf16
    temps, grads, _ = tg[("bwd", "block")]
    assert fc_grad <= grads <= 2 * fc_grad
    assert temps <= t[("bwd", "block")]
    assert tg[("bwd", "pre")][1] == V * W * 2  # the embedding's own gradient only
    assert tg[("bwd", "post")][1] == V * W * 2  # the head's


def test_a_tied_heads_contribution_is_a_temporary_in_t_and_a_gradient_in_tg() -> None:
    """The head's contribution to a tied weight waits in autograd's buffer until the embedding's
    backward adds its own: a temporary through the block's backward in T (any wrap holds it at one
    stage), the root unit's gradient in Tg (priced as ``root_grad_bytes``), never a block temporary."""
    tied, free = _peaks(tied=True), _peaks(tied=False)
    t_tied, tg_tied, t_free, tg_free = tied.temps, tied.with_grads, free.temps, free.with_grads
    head = V * W * 2
    assert t_tied[("bwd", "block")] - t_free[("bwd", "block")] == head
    assert tg_tied[("bwd", "block")][0] == tg_free[("bwd", "block")][0]
    # the embedding's backward: its contribution and the sum, both gradients
    assert tg_tied[("bwd", "pre")][1] == 2 * head


CFG = GPTConfig(num_layers=4, hidden_size=1024, num_heads=8, seq_len=1024, vocab_size=8192)


@functools.lru_cache(maxsize=None)
def _graph():
    return gpt_graph(CFG)


def _terms(**par):  # noqa: ANN202
    dp, pp, tp = par.get("dp", 1), par.get("pp", 1), par.get("tp", 1)
    plan = Plan(model=ModelRef(file=str(gpt_model_path(CFG)), num_blocks=CFG.num_layers),
                cluster=ClusterRef(profile="h100-80g", num_gpus=dp * pp * tp, gpus_per_node=8),
                training=Training(global_batch_size=dp * 4, micro_batch_size=1, seq_len=CFG.seq_len, dtype="bf16"),
                parallel=Parallel(**par))
    cfg = config_from_plan(plan)
    cluster = load_cluster("h100-80g")
    return build_terms(_graph(), cluster, cfg), holds_unit_grads(cfg, cluster)


BLOCK_GRADS = 12 * 1024 * 1024 * 2  # qkv, proj, fc1, fc2 weights of one block, bf16


@pytest.mark.parametrize("par,holds", [
    ({"dp": 8, "zero": 0}, False),  # DDP: gradients are model states
    ({"dp": 8, "zero": 1}, True),
    ({"dp": 8, "zero": 3}, True),  # beside its two gathered blocks (rehearsed: cost.zero.holds_unit_grads)
    ({"dp": 4, "pp": 2, "zero": 0, "pp_schedule": "1f1b"}, True),  # replicate
])
def test_the_block_phase_holds_unit_gradients_under_fsdp2_only(par: dict, holds: bool) -> None:
    terms, held = _terms(**par)
    ddp, _ = _terms(dp=8, zero=0)
    assert held == holds
    head = CFG.vocab_size * CFG.hidden_size * 2  # the tied head's gradient, bf16
    if holds:
        # the root unit's: the tied head's (and the final norm's), which DDP's T holds as a temporary
        assert head <= terms.root_grad_bytes <= head + 4 * CFG.hidden_size * 2
        # the block's phase: some of its own gradients, never more than all of them, beside the head's
        extra = terms.block.peak_bytes + terms.root_grad_bytes - ddp.block.peak_bytes
        assert 0.25 * BLOCK_GRADS < extra <= BLOCK_GRADS + 4 * CFG.hidden_size * 2
    else:
        assert terms.block.peak_bytes == ddp.block.peak_bytes and terms.root_grad_bytes == 0


def test_root_gradients_are_on_the_last_stage_only() -> None:
    """The root unit's gradients join the last rank's block phase (its loss phase, before the head's
    backward, has none) and no other rank's."""
    from dataclasses import replace

    terms, _ = _terms(dp=2, pp=2, zero=0, pp_schedule="1f1b")
    bare = replace(terms, root_grad_bytes=0.0)
    assert terms.root_grad_bytes > 0
    assert terms.rank_other_bytes(0, 1) == bare.rank_other_bytes(0, 1)
    assert terms.rank_other_bytes(1, 1, loss=False) - bare.rank_other_bytes(1, 1, loss=False) == pytest.approx(
        terms.root_grad_bytes, rel=1e-9)
    assert terms._loss_phase_bytes == bare._loss_phase_bytes


def test_selective_recompute_reruns_the_core_beside_the_gradients_made_behind_it() -> None:
    """Under selective recompute the attention core's forward re-runs when backward reaches it,
    after proj's and the MLP's gradients are made: FSDP2 holds them beside the re-run's forward
    temporaries (the unfused core's scores and softmax), which DDP does not."""
    from autopar.cost.compute import graph_region_time
    from autopar.graph.scaling import Shape

    rt = graph_region_time(_graph(), "block", load_cluster("h100-80g"),
                           Shape(b=1, s_ratio=1.0, kv_ratio=1.0, t=1.0))
    # the gradients there: some of the block's weights', never more than all of them
    assert 0.25 * BLOCK_GRADS < rt.bwd_grads_bytes <= BLOCK_GRADS + 8 * CFG.hidden_size * 2
    beside = rt.fwd_peak_bytes + rt.bwd_grads_bytes - rt.peak_with_grads_bytes
    assert beside > 0  # this GPT's forward peak (the core's s^2 softmax) with them tops backward's Tg'

    def working(**par) -> float:  # noqa: ANN003
        return _terms(recompute="selective", **par)[0].transient_bytes - _terms(**par)[0].transient_bytes

    assert working(dp=8, zero=1) == pytest.approx(rt.core_saved_bytes + beside)
    # DDP: gradients are model states; the core re-runs under autocast (fp32 probabilities: graph/cuda_autocast.py)
    assert working(dp=8, zero=0) == pytest.approx(rt.autocast_core_saved_bytes)
    assert rt.autocast_core_saved_bytes > rt.core_saved_bytes
