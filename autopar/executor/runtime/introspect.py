"""What the executor needs to know about a user's model: the model spec (``autopar.spec``), read
from the meta-device build.

Nothing here allocates memory or touches torch.distributed: ``inspect_model`` runs before the
process group exists so a wrong plan fails fast with a one-line ``AutoparError`` (no hang).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from autopar.errors import AutoparError
from autopar.modelfile import ModelFile
from autopar.spec import ModelSpec, model_spec

__all__ = ["ModelSpec", "example_shape_check", "get_submodule", "inspect_model"]


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path) if path else root


def inspect_model(mf: ModelFile, model: nn.Module) -> ModelSpec:
    """The ModelSpec of ``model`` (built on meta from ``mf``): the one owner of these facts is
    ``autopar.spec``; the planner reads the same object."""
    return model_spec(mf, model)


def example_shape_check(inputs: Any, where: str, need_sequence: bool) -> None:
    """PP needs tensor / tuple-of-tensor inputs; CP additionally a (batch, seq) token tensor."""
    if need_sequence and not (hasattr(inputs, "dim") and inputs.dim() == 2):
        raise AutoparError(
            f"{where}: context parallelism needs example_inputs() to return one (batch, seq) token tensor"
        )
