"""A bounded memo keyed by objects' identities (the cost model's caches: links, region times, the
terms offload modes share).

Graphs and cluster profiles are immutable once built but hashing one by value costs more than the
lookup saves, so entries are keyed by ``id()``. Each entry also holds the objects themselves, so an
id cannot be reused by another object while its entry lives, and a hit is checked by identity.
The memo empties itself when full (tests and sweeps make many short-lived profiles)."""

from __future__ import annotations

from typing import Any, Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class IdentityMemo(Generic[V]):
    def __init__(self, max_entries: int) -> None:
        self._entries: dict[tuple, tuple[tuple[Any, ...], V]] = {}
        self._max = max_entries

    def get(self, owners: tuple[Any, ...], key: Hashable, make: Callable[[], V]) -> V:
        """The value for (``owners`` by identity, ``key`` by value), made by ``make()`` on a miss."""
        full_key = (tuple(map(id, owners)), key)
        hit = self._entries.get(full_key)
        if hit is not None:
            held = hit[0]
            for i, o in enumerate(owners):  # a loop, not all(<generator>): this runs ~10 times per terms build
                if held[i] is not o:
                    break
            else:
                return hit[1]
        value = make()
        if len(self._entries) >= self._max:
            self._entries.clear()
        self._entries[full_key] = (owners, value)
        return value
