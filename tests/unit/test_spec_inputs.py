"""The spec's meta forwards run on the token inputs cut short when a full-length forward dispatches
too many ops (spec/spec_inputs.py: HF RWKV's per-position loop made the spec alone take ~50 s of
the 60 s a full-size plan has for tracing), and on the inputs as they are otherwise."""

from __future__ import annotations

import torch

from autopar.spec.meta import tolerant_meta
from autopar.spec.spec_inputs import SHORT_SEQ, SPEC_OP_LIMIT, cut_tokens, spec_inputs


def _looping(batch):
    ids = batch["input_ids"] if isinstance(batch, dict) else batch
    with tolerant_meta():
        state = torch.zeros(4, device="meta")
        for _ in range(ids.shape[1]):  # a Python loop over positions: ops grow with the sequence
            state = state * 0.5 + 1.0
    return state


def _plain(batch):
    with tolerant_meta():
        return torch.zeros(4, device="meta") + 1.0


def test_a_forward_that_loops_over_positions_gets_short_tokens() -> None:
    ids = torch.empty(1, SPEC_OP_LIMIT, dtype=torch.long, device="meta")
    got = spec_inputs({"input_ids": ids, "labels": ids, "pixel_mask": torch.empty(3, device="meta")}, _looping)
    assert got["input_ids"].shape == (1, SHORT_SEQ) and got["labels"].shape == (1, SHORT_SEQ)
    assert got["pixel_mask"].shape == (3,)  # not of the tokens' shape: kept


def test_a_cheap_forward_keeps_its_inputs() -> None:
    ids = torch.empty(1, 4096, dtype=torch.long, device="meta")
    assert spec_inputs(ids, _plain) is ids


def test_only_token_inputs_are_cut() -> None:
    assert cut_tokens(torch.empty(1, 4096, device="meta"), SHORT_SEQ) is None  # floats: features, not tokens
    assert cut_tokens({"pixel_values": torch.empty(1, 3, 8, 8)}, SHORT_SEQ) is None
    assert cut_tokens(torch.zeros(1, SHORT_SEQ, dtype=torch.long), SHORT_SEQ) is None  # not longer
