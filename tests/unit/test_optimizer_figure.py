"""The profile's optimizer figure is timed on the model's own parameter shapes (profiler.kernels)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from autopar.commands.profile import _param_shapes
from autopar.modelfile import load_model_file
from autopar.profiler import kernels

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo" / "odd_names_decoder.py"


class _Recorder(torch.optim.AdamW):
    seen: list[list[tuple[int, ...]]] = []

    def __init__(self, params, **kw) -> None:  # noqa: ANN001
        params = list(params)
        _Recorder.seen.append([tuple(p.shape) for p in params])
        super().__init__(params, **kw)


def test_the_one_block_models_shapes_are_what_adamw_steps(monkeypatch) -> None:
    shapes = _param_shapes(load_model_file(ZOO))
    assert shapes and all(isinstance(s, tuple) for s in shapes)
    monkeypatch.setattr(torch.optim, "AdamW", _Recorder)
    _Recorder.seen.clear()
    secs = kernels.optimizer_s_per_param(torch.device("cpu"), repeats=1, shapes=shapes)
    assert secs > 0 and _Recorder.seen == [shapes]


def test_too_many_parameters_or_none_fall_back_to_the_synthetic_tensors(monkeypatch) -> None:
    monkeypatch.setattr(torch.optim, "AdamW", _Recorder)
    monkeypatch.setattr(kernels, "OPTIMIZER_MAX_PARAMS", 1000)
    for shapes in (None, [(64, 64)]):
        _Recorder.seen.clear()
        kernels.optimizer_s_per_param(torch.device("cpu"), repeats=1, shapes=shapes)
        assert _Recorder.seen == [[(2**18,)] * 16]
    assert math.prod((64, 64)) > kernels.OPTIMIZER_MAX_PARAMS
