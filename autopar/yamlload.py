"""Strict YAML reading for autopar's input files: ``yaml.SafeLoader``, no duplicate keys, bounded
size, depth and alias expansion, finite numbers.

PyYAML's ``safe_load`` constructs only plain types (no ``!!python`` tags), but it accepts a mapping
that repeats a key and keeps the last value silently, it reads a file of any size (a 59 MB plan
took minutes and gigabytes), its composer recurses once per nesting level (50,000 levels: a
RecursionError of 3,000 lines), and aliases let 1 KB expand into billions of values ("billion
laughs": the constructed value shares its parts, but printing or walking it does not). And YAML
spells NaN and infinity (``.nan``, ``.inf``), which no figure autopar reads can be.

``load_yaml`` therefore: refuses a file above a bound before parsing it (``check_size``); walks
the parser's events -- a state machine, no recursion -- refusing nesting deeper than
``MAX_DEPTH`` and a document whose aliases expand it past ``MAX_VALUES`` values (``check_shape``);
composes with ``StrictLoader``, which refuses a repeated key with the line of both occurrences;
and refuses a non-finite number, naming where it is (``check_finite``), never the value.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from autopar.errors import AutoparError

# A plan of 16,384 GPUs with its prediction section is well under 1 MiB; 4 MiB leaves room.
MAX_INPUT_BYTES = 4 * 2**20
MAX_DEPTH = 64  # a plan or profile nests 4-6 levels
MAX_VALUES = 1_000_000  # scalars, mappings and sequences once aliases are expanded (a measured profile: ~10^4)


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


def check_shape(text: str, source: str, max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES) -> None:
    """Refuse ``text`` nested deeper than ``max_depth`` or expanding, aliases followed, to more
    than ``max_values`` values (module docstring); yaml.YAMLError propagates. Linear in the events:
    each collection's expanded size is summed as it closes and kept under its anchor."""
    sizes: dict[str, int] = {}  # anchor -> values its node expands to
    stack: list[tuple[str | None, int]] = []  # open collections: (anchor, values so far)
    for event in yaml.parse(text, Loader=StrictLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            stack.append((event.anchor, 1))
            if len(stack) > max_depth:
                raise AutoparError(f"{source} nests deeper than {max_depth} levels (line {event.start_mark.line + 1}); "
                                   "no autopar file needs more than a few")
            continue
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, count = stack.pop()
            if anchor is not None:
                sizes[anchor] = count
        elif isinstance(event, yaml.ScalarEvent):
            count = 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            count = sizes.get(event.anchor, 1)
        else:
            continue
        if stack:
            anchor, so_far = stack[-1]
            stack[-1] = (anchor, so_far + count)
        if count > max_values or (stack and stack[-1][1] > max_values):
            line = event.start_mark.line + 1
            raise AutoparError(f"{source}: its aliases expand it past {max_values:,} values (line {line}); "
                               "write the values out instead of repeating anchors")


def check_finite(data: Any, source: str) -> None:
    """Refuse a NaN or an infinity anywhere in ``data``, naming its place (``gpu.peak_flops``,
    ``parallel.stages[2]``), never its value. Iterative; shared parts are visited once."""
    seen: set[int] = set()
    todo: list[tuple[Any, str]] = [(data, "")]
    while todo:
        value, path = todo.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                where = path or "the document"
                raise AutoparError(f"{source}: {where} is not a finite number; give a number")
        elif isinstance(value, (dict, list)):
            if id(value) in seen:
                continue
            seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(value, dict):
                    name = str(key) if isinstance(key, (str, int)) and len(str(key)) <= 40 else "<key>"
                    todo.append((item, f"{path}.{name}" if path else name))
                else:
                    todo.append((item, f"{path}[{key}]"))


def load_yaml(text: str, source: str, max_bytes: int = MAX_INPUT_BYTES) -> Any:
    """Parse ``text`` with StrictLoader after ``check_size`` and ``check_shape``, then
    ``check_finite``; yaml.YAMLError (DuplicateKeyError included) propagates, the bounds raise
    AutoparError with one line."""
    check_size(len(text), source, max_bytes)  # characters <= bytes: a cheap, sufficient bound
    check_shape(text, source)
    data = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
    check_finite(data, source)
    return data
