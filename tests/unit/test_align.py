"""graph/align.py gives difflib's matching blocks (``SequenceMatcher(autojunk=False)``), element for
element, on random sequences of small alphabets and on loop-like ones (a prologue, a body repeated
a different number of times, an epilogue: a trace against its half-sequence trace), and does not
take quadratic time on a long loop."""

from __future__ import annotations

import difflib
import random
import time

import pytest

from autopar.graph.align import matching_blocks


def _difflib(a: list, b: list) -> list[tuple[int, int, int]]:
    return [tuple(m) for m in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks()]


@pytest.mark.parametrize("seed", range(4))
def test_the_blocks_are_difflib_s(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        alphabet = rng.randint(1, 4)
        if rng.random() < 0.4:
            body = [rng.randint(0, alphabet) for _ in range(rng.randint(1, 4))]
            head, tail = [9] * rng.randint(0, 3), [8] * rng.randint(0, 5)
            a = head + body * rng.randint(2, 12) + tail
            b = head + body * rng.randint(1, 6) + tail
        else:
            a = [rng.randint(0, alphabet - 1) for _ in range(rng.randint(0, 40))]
            b = [rng.randint(0, alphabet - 1) for _ in range(rng.randint(0, 40))]
        assert matching_blocks(a, b) == _difflib(a, b), (a, b)


def test_a_long_loop_aligns_in_linear_time() -> None:
    body, back = [("fwd", "mul"), ("fwd", "add")], [("bwd", "mul"), ("bwd", "select_backward"), ("bwd", "add")]
    a = [("fwd", "embedding")] + body * 4000 + [("bwd", "sum")] + back * 4000
    b = [("fwd", "embedding")] + body * 2000 + [("bwd", "sum")] + back * 2000
    start = time.process_time()
    blocks = matching_blocks(a, b)
    assert time.process_time() - start < 2.0  # difflib: tens of seconds
    assert sum(k for _, _, k in blocks) == len(b)  # every op of the shorter trace paired
