"""Blocks kept in an ``nn.ModuleDict`` keyed by layer number, as torchtitan writes its models.

torchtitan's models hold their layers in ``nn.ModuleDict`` with keys ``"0" .. "n-1"`` (so that a
pipeline stage can delete the layers it does not own and keep the others' parameter names) and run
them with ``for layer in self.layers.values()``. Such a dict is the same block list as an
``nn.ModuleList`` -- same children, same parameter names (``layers.3.attention.wq.weight``) -- only
its container answers a dict's calls. ``BlockDict`` is that ModuleDict with a list's integer index
added: ``blocks[i]`` is its i-th child, so autopar reads, shards and splits it as it does a list,
while the model's own forward keeps every dict call it makes (``values()``, ``items()``,
``keys()``, ``blocks["3"]``, iteration over keys). ``adopt_block_dicts`` gives every such dict of a
freshly built model that class (``ModelFile.build``); it adds no state, so a state dict, a deep
copy and the parameter names are those of the model the file built.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class BlockDict(nn.ModuleDict):
    """An ``nn.ModuleDict`` of blocks keyed ``"0" .. "n-1"`` that also takes an integer index (its
    i-th child, negative counting from the end) or a slice (a list of children)."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)) and not isinstance(key, bool):
            return list(self._modules.values())[key]
        return super().__getitem__(key)


def numbered_keys(mod: nn.ModuleDict) -> bool:
    """Whether ``mod``'s keys are ``"0" .. "n-1"`` in order, for n >= 1."""
    keys = list(mod.keys())
    return bool(keys) and keys == [str(i) for i in range(len(keys))]


def adopt_block_dicts(model: nn.Module) -> int:
    """Make every plain ``nn.ModuleDict`` of ``model`` keyed ``"0" .. "n-1"`` a ``BlockDict`` (in place);
    returns how many. A subclass of ModuleDict is left as its author wrote it."""
    count = 0
    for mod in model.modules():
        if type(mod) is nn.ModuleDict and numbered_keys(mod):
            mod.__class__ = BlockDict
            count += 1
    return count
