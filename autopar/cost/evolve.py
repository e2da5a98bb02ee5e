"""``evolve``: ``dataclasses.replace`` for the cost model's frozen value classes, at a tenth of its cost.

The search copies ``StageTerms`` (25 fields) and ``Config`` (18) with one or two fields changed
about 10^4 times per search; ``dataclasses.replace`` re-runs ``__init__`` field by field through
the frozen ``object.__setattr__`` and was a tenth of a first search. A class with a
``__post_init__`` (one that validates itself) is copied by ``replace`` itself, so no check is
ever skipped. What a ``functools.cached_property`` stored on ``obj`` is not copied: the copy
derives its own."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def evolve(obj: T, **changes: Any) -> T:
    """A copy of the dataclass instance ``obj`` with ``changes`` applied, equal to
    ``dataclasses.replace(obj, **changes)``; unknown field names raise TypeError as there."""
    cls = type(obj)
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        return dataclasses.replace(obj, **changes)
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    for name in changes:
        if name not in fields:
            raise TypeError(f"{cls.__name__} has no field {name!r}")
    new = object.__new__(cls)
    state = obj.__dict__
    if len(state) != len(fields):  # values a functools.cached_property stored: derived, so not copied
        state = {name: value for name, value in state.items() if name in fields}
    new.__dict__.update(state)
    new.__dict__.update(changes)
    return new
