"""Strict YAML reading for autopar's input files: ``yaml.SafeLoader``, no duplicate keys, bounded size.

PyYAML's ``safe_load`` constructs only plain types (no ``!!python`` tags), but it accepts a mapping
that repeats a key and keeps the last value silently, and it reads a file of any size (a 59 MB
plan took minutes and gigabytes). ``StrictLoader`` refuses a repeated key with the line of both
occurrences; ``check_size`` refuses a file above a bound before parsing it.
"""

from __future__ import annotations

from typing import Any

import yaml

from autopar.errors import AutoparError

# A plan of 16,384 GPUs with its prediction section is well under 1 MiB; 4 MiB leaves room.
MAX_INPUT_BYTES = 4 * 2**20


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping names the same key twice."""


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            if first is not None:
                raise DuplicateKeyError(
                    None, None, f"duplicate key {key!r} (first at line {first.line + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def check_size(size_bytes: int, source: str, max_bytes: int = MAX_INPUT_BYTES) -> None:
    if size_bytes > max_bytes:
        raise AutoparError(f"{source} is {size_bytes / 2**20:,.1f} MiB; autopar reads input files of at most "
                           f"{max_bytes / 2**20:g} MiB (is it the right file?)")


def load_yaml(text: str, source: str, max_bytes: int = MAX_INPUT_BYTES) -> Any:
    """Parse ``text`` with StrictLoader; yaml.YAMLError (DuplicateKeyError included) propagates."""
    check_size(len(text), source, max_bytes)  # characters <= bytes: a cheap, sufficient bound
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
