"""Pipeline chunks of a layer chain (executor/parallel/chain_pipeline.py), in one process: the chunks of any
partition, run one after another, compute exactly the full model, and hold its parameters once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.executor.parallel.chain_pipeline import build_chain_chunk, probe_chain_shapes, unit_modules
from autopar.executor.parallel.pipeline_parallel import STAGE_ATTR, STAGE_PREFIX
from autopar.modelfile import load_model_file
from autopar.spec import model_spec

MODELS = Path(__file__).resolve().parents[1] / "dist" / "models"
ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"


def _run_chunks(path: Path, ranges: list[tuple[int, int]]):
    mf = load_model_file(path)
    spec = model_spec(mf)
    torch.manual_seed(0)
    model = mf.build("cpu")
    x = mf.example_inputs(2, "cpu")
    meta_x = mf.example_inputs(2, "meta")
    shapes = probe_chain_shapes(mf.build("meta"), spec, meta_x)
    n = len(ranges)
    chunks = [build_chain_chunk(model, spec, shapes, r, is_first=c == 0, is_last=c == n - 1, meta_inputs=meta_x)
              for c, r in enumerate(ranges)]
    act = x
    with torch.no_grad():
        for ch in chunks:
            act = ch(act)
        want = model(x)
    return model, spec, chunks, act, want


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 5)], [(0, 1), (1, 3), (3, 5)], [(0, 4), (4, 5)]], ids=str)
def test_resnet_chunks_compute_the_full_model(ranges) -> None:
    model, spec, chunks, got, want = _run_chunks(MODELS / "chain_resnet.py", ranges)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    names = [{n.removeprefix(STAGE_PREFIX) for n, _ in ch.named_parameters()} for ch in chunks]
    assert set().union(*names) == {n for n, _ in model.named_parameters()}
    assert sum(len(s) for s in names) == len(list(model.parameters())), "every parameter on exactly one chunk"
    for ch, (a, b) in zip(chunks, ranges):  # FSDP2 and recompute see exactly the chunk's units
        mine = [ch.get_submodule(STAGE_PREFIX + spec.chain.units[i]) for i in range(a, b)]
        assert [id(m) for m in unit_modules(ch, spec, STAGE_PREFIX)] == [id(m) for m in mine]


def test_vit_chunks_keep_the_class_token_on_the_first_stage() -> None:
    model, spec, chunks, got, want = _run_chunks(ZOO / "vit.py", [(0, 1), (1, 4)])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    first, second = chunks
    assert isinstance(getattr(first, STAGE_ATTR).cls_token, nn.Parameter) and not getattr(first, STAGE_ATTR).cls_token.is_meta
    later = getattr(second, STAGE_ATTR).cls_token
    assert not isinstance(later, nn.Parameter) and later.is_meta  # read on meta, never trained there
    assert STAGE_PREFIX + "cls_token" not in dict(second.named_parameters())
    # stand-ins in the Sequential get non-digit keys: code walking digit keys sees real blocks only
    assert [k for k in getattr(second, STAGE_ATTR).blocks._modules if k.isdigit()] == ["1", "2", "3"]
    assert [k for k in getattr(first, STAGE_ATTR).blocks._modules if k.isdigit()] == ["0"]
