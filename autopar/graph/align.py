"""Matching blocks of two op sequences: the pairs ``difflib.SequenceMatcher(autojunk=False)`` gives,
in time linear per block rather than quadratic.

``graph/scaling.py`` pairs each op of a trace with its counterpart in a trace at another shape by a
sequence alignment on (phase, op name). ``difflib`` finds, recursively, the longest common run
(ties: the earliest in the first sequence, then in the second), then the blocks left and right of
it. Its search for the longest run walks, for every element of the first sequence, every position
of the second holding the same element: on a loop over positions -- a few kinds of op repeated
thousands of times -- that is quadratic (HF RWKV-7B's half-sequence alignment took ~100 s).

Here each longest run is found with a suffix automaton of the second sequence's range (states with
the end of their first occurrence), scanning the first range once: the longest match ending at
each element, and where it first occurs. The blocks and their order are difflib's, element for
element (tests/unit/test_align.py checks it on random sequences of small alphabets).
"""

from __future__ import annotations

from typing import Hashable, Sequence


def _longest(a: Sequence[int], alo: int, ahi: int, b: Sequence[int], blo: int, bhi: int) -> tuple[int, int, int]:
    """(i, j, k): the longest common run a[i:i+k] == b[j:j+k] inside the ranges, the earliest in
    ``a`` among the longest, then the earliest in ``b``; (alo, blo, 0) when there is none."""
    length, link, first = [0], [-1], [-1]
    step: list[dict[int, int]] = [{}]
    last = 0
    for pos in range(blo, bhi):
        c = b[pos]
        cur = len(length)
        length.append(length[last] + 1)
        link.append(-1)
        first.append(pos)
        step.append({})
        p = last
        while p != -1 and c not in step[p]:
            step[p][c] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = step[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                length.append(length[p] + 1)
                link.append(link[q])
                first.append(first[q])
                step.append(dict(step[q]))
                while p != -1 and step[p].get(c) == q:
                    step[p][c] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        last = cur
    best = (alo, blo, 0)
    state, matched = 0, 0
    for i in range(alo, ahi):
        c = a[i]
        while state and c not in step[state]:
            state = link[state]
            matched = length[state]
        if c in step[state]:
            state = step[state][c]
            matched += 1
        else:
            state, matched = 0, 0
        if matched > best[2]:  # strictly longer: an earlier end in ``a`` keeps a tie
            best = (i - matched + 1, first[state] - matched + 1, matched)
    return best


def matching_blocks(a: Sequence[Hashable], b: Sequence[Hashable]) -> list[tuple[int, int, int]]:
    """``difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks()`` as (i, j, size)
    triples, ending with (len(a), len(b), 0)."""
    codes: dict[Hashable, int] = {}
    ca = [codes.setdefault(x, len(codes)) for x in a]
    cb = [codes.setdefault(x, len(codes)) for x in b]
    found = []
    pending = [(0, len(ca), 0, len(cb))]
    while pending:
        alo, ahi, blo, bhi = pending.pop()
        i, j, k = _longest(ca, alo, ahi, cb, blo, bhi)
        if k:
            found.append((i, j, k))
            if alo < i and blo < j:
                pending.append((alo, i, blo, j))
            if i + k < ahi and j + k < bhi:
                pending.append((i + k, ahi, j + k, bhi))
    found.sort()
    merged: list[tuple[int, int, int]] = []
    for i, j, k in found:  # adjacent blocks become one, as difflib reports them
        if merged and merged[-1][0] + merged[-1][2] == i and merged[-1][1] + merged[-1][2] == j:
            pi, pj, pk = merged[-1]
            merged[-1] = (pi, pj, pk + k)
        else:
            merged.append((i, j, k))
    merged.append((len(ca), len(cb), 0))
    return merged
