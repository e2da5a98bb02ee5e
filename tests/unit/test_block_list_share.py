"""A list of identical blocks that holds a small part of a hierarchical model is not its blocks
(spec/blocks.py ``find_block_list``): Hiera-L's stages are lists whose first layer differs (query
pooling, a wider output), so the one list of identical layers was its first stage's two -- 0.2 % of
the parameters -- and the other 99.8 % were priced as an epilogue, never pipelined. Where the list
holds less than half of what the outermost lists hold, the model is read as their chain."""

from __future__ import annotations

from torch import nn

from autopar.spec.blocks import find_block_list


class Layer(nn.Module):
    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.fc = nn.Linear(d, d)


class Stage(nn.Module):
    def __init__(self, d_in: int, d: int, depth: int) -> None:
        super().__init__()
        # the first layer widens the stage (pooled, wider): it differs from the rest
        self.layers = nn.ModuleList([Layer(d_in, d)] + [Layer(d, d) for _ in range(depth - 1)])


def _model(depths: tuple[int, ...], widths: tuple[int, ...]) -> nn.Module:
    ins = (widths[0],) + widths[:-1]
    model = nn.Module()
    model.stages = nn.ModuleList(Stage(a, b, n) for a, b, n in zip(ins, widths, depths))
    return model


def test_a_small_list_of_identical_blocks_leaves_the_model_a_chain() -> None:
    # stage 0 keeps its width (its layers identical: a block list of 2); the others widen
    model = _model((2, 6, 36, 4), (16, 32, 64, 128))
    assert find_block_list(model, None) is None


def test_a_list_holding_most_of_the_model_stays_its_blocks() -> None:
    model = _model((8, 2), (64, 32))  # the identical first stage holds most of the parameters
    assert find_block_list(model, None) == "stages.0.layers"


def test_a_container_of_mixed_modules_is_not_counted_as_a_list_of_layers() -> None:
    # a large vocabulary in an nn.Sequential(Embedding, Dropout) beside two small blocks: no stages
    model = nn.Module()
    model.embed = nn.Sequential(nn.Embedding(50_000, 64), nn.Dropout(0.0))
    model.blocks = nn.ModuleList(Layer(64, 64) for _ in range(2))
    assert find_block_list(model, None) == "blocks"
