"""Pipeline markers that answer, for the module whose place they take, what model code reads of it.

A pipeline chunk replaces the modules another stage runs by markers (executor/parallel/pipeline_parallel.py,
executor/parallel/chain_pipeline.py). The model's own forward still runs on every stage, and model code reads
settings off its blocks before calling them: Hugging Face ModernBERT picks a block's mask by
``layer.attention_type``, Swin's encoder asks ``stage.downsample is not None`` to track the image
size. A ``StandIn`` answers such reads as the original module would: its plain attributes (strings,
numbers, configs) by value, its parameters and buffers as meta tensors of their shapes (``.shape``,
``.dtype`` read, nothing allocated or trained), and its child modules as ``AbsentModule``s that
answer the same way, recursively. Calling an absent module is an error that names it: the module
runs on another stage, so its result here would be wrong.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["AbsentModule", "StandIn", "attributes_of"]


def attributes_of(original: nn.Module, path: str) -> dict[str, Any]:
    """What model code may read off ``original`` (module docstring), keyed by attribute name."""
    out: dict[str, Any] = {k: v for k, v in vars(original).items() if not k.startswith("_") and k != "training"}
    for name, t in [*original._parameters.items(), *original._buffers.items()]:
        if t is not None:
            out[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        else:
            out[name] = None
    for name, child in original._modules.items():
        out[name] = None if child is None else AbsentModule(child, f"{path}.{name}" if path else name)
    return out


class AbsentModule:
    """A child of a replaced module: answers attribute reads, refuses calls (module docstring).
    Not an ``nn.Module``, so nothing registers, moves, shards or trains it."""

    def __init__(self, original: nn.Module, path: str) -> None:
        self._path, self._type = path, type(original).__name__
        self._attrs = attributes_of(original, path)

    def __getattr__(self, name: str) -> Any:
        attrs = self.__dict__.get("_attrs", {})
        if name in attrs:
            return attrs[name]
        where = f"{self.__dict__.get('_type')} {self.__dict__.get('_path')!r}"
        raise AttributeError(f"{where} (on another pipeline stage) has no attribute {name!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"autopar pipeline: model code called {self._path} ({self._type}) directly, on a stage "
                           "that does not hold it; a pipeline stage calls only its own modules")


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


class StandIn(nn.Module):
    """Base of the pipeline markers: ``stand_for(original, path)`` makes the marker answer attribute
    reads as ``original`` would (module docstring). Its own attributes come first.

    It also runs the forward hooks registered on the original: transformers 5 records hidden states
    by hooks on the modules of a class, installed at the model's first forward (Segformer's
    ``OutputRecorder(SegformerStage)``; its decode head reads every stage's map), so a stand-in
    without them dropped its entry from the list -- the last pipeline stage saw one map instead of
    two. It does not pass ``isinstance`` for the original's class: with that, HF Llama's and Qwen2's
    4-rank pipelines (tests/dist/test_hf_models.py) failed -- code that finds modules by class took
    a marker for the block it replaces."""

    def stand_for(self, original: nn.Module, path: str) -> "StandIn":
        if not isinstance(original, StandIn):
            self.__dict__["_stands_for"] = attributes_of(original, path)
        else:
            self.__dict__["_stands_for"] = dict(original.__dict__.get("_stands_for", {}))
        for hooks in _HOOK_DICTS:  # the hooks model code put on the original fire on its stand-in
            getattr(self, hooks).update(getattr(original, hooks, {}))
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            attrs = self.__dict__.get("_stands_for", {})
            if name in attrs:
                return attrs[name]
            raise
