"""FSDP2 pads each parameter's dim 0 to a multiple of the shard degree, and a gathered parameter is
a view of the padded all-gather output (RegionParams.padding): a ViT's position embedding, one row
of 257 x 1280, holds N rows' room over N ranks. Checked against FSDP2's own padded sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.graph.model_graph import RegionParams

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _fsdp_gathered_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of the all-gather output FSDP2 allocates for a parameter of ``shape`` over ``shards``
    ranks: each rank's chunk padded to the first chunk's rows (torch.chunk on dim 0), N of them."""
    first = torch.chunk(torch.empty(shape, device="meta"), shards, dim=0)[0]
    return shards * first.numel()


@pytest.mark.parametrize("shards", [1, 2, 8, 64, 1024])
def test_padding_is_what_fsdp_gathers_beyond_the_parameters(shards: int) -> None:
    shapes = [(1, 257, 1280), (1, 1, 1280), (1280,), (3840, 1280), (1000, 1280), (7,)]
    params = RegionParams(count=sum(torch.Size(s).numel() for s in shapes), tp_sharded=0,
                          shapes=tuple((s[0], torch.Size(s).numel() // s[0], 1) for s in shapes))
    want = sum(_fsdp_gathered_numel(s, shards) - torch.Size(s).numel() for s in shapes)
    assert params.padding(shards) == want
    assert RegionParams(count=10, tp_sharded=0).padding(shards) == 0  # shapes not recorded: none priced


def test_a_vits_embedding_padding_is_priced_on_its_rank() -> None:
    from autopar.cluster import load_cluster
    from autopar.cost.evolve import evolve
    from autopar.cost.stage import Config, build_terms
    from autopar.graph.measure import build_graph

    graph = build_graph(str(EXAMPLES / "zoo" / "vit.py"))  # tiny: dim 64, 16 patches and a class token
    pre = graph.params["pre"]
    assert (1, 17 * 64, 1) in pre.shapes  # the position embedding, one row
    cluster = load_cluster("h100-80g")

    def terms(dp: int, zero: int):  # noqa: ANN202
        return build_terms(graph, cluster, Config(dp=dp, tp=1, pp=1, cp=1, cp_kind="ring", sequence_parallel=False,
                                                  zero=zero, recompute="none", schedule="1f1b", virtual_stages=1,
                                                  micro_batch=1, global_batch=dp, seq_len=graph.seq_len, dtype_bytes=2,
                                                  optimizer="adam"))

    at64 = terms(64, 1)
    assert at64.pre_padding_bytes == pre.padding(64) * 2 >= 63 * 17 * 64 * 2
    assert terms(64, 0).pre_padding_bytes == 0.0  # DDP gathers nothing
    without = evolve(at64, pre_padding_bytes=0.0)
    assert at64.rank_other_bytes(0, 0) - without.rank_other_bytes(0, 0) == pytest.approx(at64.pre_padding_bytes)


def test_a_blocks_padding_is_held_with_its_gathered_parameters_at_zero_1_and_2() -> None:
    """ZeRO-1/2 keep each block's gathered parameters from forward to the step's end, padding and all
    (ViT-H at 1,024 H100s, dp 512: fc2's 1,280 rows pad to 1,536, 3.9 MB a block; its pp 2 stages
    rehearsed -1.1 / -1.4 % before, 0.0 % after: docs/results.md); ZeRO-3 prices it in its gathered
    blocks, DDP gathers nothing."""
    from autopar.cluster import load_cluster
    from autopar.cost.stage import Config, build_terms
    from autopar.cost.step import evaluate
    from autopar.graph.measure import build_graph

    graph = build_graph(str(EXAMPLES / "zoo" / "vit.py"))  # tiny: dim 64, mlp 128
    cluster = load_cluster("h100-80g")
    block = graph.params["block"]

    def terms(zero: int):  # noqa: ANN202
        return build_terms(graph, cluster, Config(dp=48, tp=1, pp=1, cp=1, cp_kind="ring", sequence_parallel=False,
                                                  zero=zero, recompute="none", schedule="1f1b", virtual_stages=1,
                                                  micro_batch=1, global_batch=48, seq_len=graph.seq_len, dtype_bytes=2,
                                                  optimizer="adam"))

    assert block.padding(48) > 0  # 64 and 128 rows over 48 ranks
    for zero in (1, 2):
        t = terms(zero)
        assert t.block_padding_bytes == block.padding(48) * 2
        est = evaluate(t, [graph.num_blocks], 1.0, 1.0, 1.0)
        states = est.ranks[0].params * t.state_split["params"]
        assert est.ranks[0].memory_bytes["params"] == pytest.approx(states + graph.num_blocks * t.block_padding_bytes)
    assert terms(0).block_padding_bytes == terms(3).block_padding_bytes == 0.0
