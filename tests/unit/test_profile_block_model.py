"""The profiler's block model: the model cut to its first block, or whole where the cut model does not
run (a U-Net's decoder pops the skip connections its encoder blocks pushed)."""

from __future__ import annotations

from pathlib import Path

from autopar.modelfile import load_model_file
from autopar.profiler.layers import block_model
from autopar.spec import model_spec

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"


def _units(model, container: str) -> int:
    return len(model.get_submodule(container))


def test_a_chain_whose_cut_model_fails_is_profiled_whole_and_one_that_runs_is_cut() -> None:
    for name, whole in (("torch_unet", True), ("resnet", False)):
        mf = load_model_file(ZOO / f"{name}.py")
        meta = mf.build("meta")
        path = model_spec(mf, meta).blocks_path
        got = block_model(mf, meta, path)
        assert (got is meta) == whole, name
        assert _units(got, path) == (_units(meta, path) if whole else 1), name
