"""validate's CPU memory measure lists the live tensors without printing torch's deprecation warnings."""

import warnings

import torch
import torch.distributed  # noqa: F401  (holds the deprecated reduce_op object the collector sees)

from autopar.commands.validate import live_tensors


def test_live_tensors_finds_tensors_and_parameters():
    t, p = torch.ones(3), torch.nn.Parameter(torch.zeros(2))
    found = live_tensors()
    assert any(o is t for o in found) and any(o is p for o in found)


def test_live_tensors_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        live_tensors()
