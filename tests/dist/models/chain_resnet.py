"""Test fixture: the model zoo's ResNet (examples/zoo/resnet.py) with 2 blocks in its second
stage, so that one unit kind repeats inside a stage of the layer chain."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_zoo_resnet", Path(__file__).resolve().parents[3] / "examples" / "zoo" / "resnet.py")
_zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_zoo)

CFG = dict(_zoo.SIZES["tiny"], depths=(1, 2, 1, 1))
_zoo.CFG = CFG  # the zoo file's example_inputs and loss_fn read its CFG


def build_model():
    return _zoo.ResNet(**CFG)


example_inputs = _zoo.example_inputs
loss_fn = _zoo.loss_fn
