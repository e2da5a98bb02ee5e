"""The sequence dimension is found by how the model takes its inputs, never by a size alone: a channel
count that equals SEQ_LEN (Whisper's 16 mel bins at SEQ_LEN 16) is kept whole when the planner cuts the
sequence (autopar.graph.build.sequence_keep)."""

from __future__ import annotations

from pathlib import Path

import torch

from autopar import api
from autopar.graph.build import sequence_keep, slice_sequence

MODEL = Path(__file__).resolve().parents[1] / "data" / "models" / "channels_equal_seq.py"


def test_a_dimension_the_model_cannot_take_shortened_is_kept_whole() -> None:
    inputs = {"features": torch.zeros(2, 16, 16), "ids": torch.zeros(2, 16)}

    def runs(inp: dict) -> bool:  # a stem that needs its 16 channels; any sequence length goes
        return inp["features"].shape[1] == 16

    assert not runs(slice_sequence(inputs, 16, 8))  # by size alone the channels are cut
    keep = sequence_keep(inputs, 16, 8, runs)
    assert keep == {(0, 1)}
    cut = slice_sequence(inputs, 16, 8, keep)
    assert cut["features"].shape == (2, 16, 8) and cut["ids"].shape == (2, 8)


def test_nothing_is_kept_when_no_choice_runs() -> None:
    assert sequence_keep({"x": torch.zeros(2, 16)}, 16, 8, lambda inp: False) == frozenset()


def test_a_model_whose_channels_equal_seq_len_plans_at_its_sequence_and_a_shorter_one() -> None:
    for seq in (None, 8):
        found = api.plan_search(MODEL, 8, "a100-80g", top=1, seq_len=seq, global_batch=64, use_cache=False)
        assert found.graph.seq_len == (seq or 16) and found.plans
