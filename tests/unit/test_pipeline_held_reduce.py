"""Under a pipeline, FSDP2's last reduce-scatter input of a micro-batch's backward outlives it:
torch pipelining runs each backward with is_last_backward off, so the final callback keeps the
input until the next micro-batch's first reduce, and that micro-batch's first block to run backward
meets it beside every activation (StageTerms._first_backward_held_bytes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_unit_grad_peaks import _terms


def test_zero3_under_a_pipeline_holds_the_last_reduced_units_fp32_gradients() -> None:
    terms, _ = _terms(dp=2, pp=2, zero=3, pp_schedule="1f1b")
    assert terms.pipeline_held_reduce_bytes_per_param == 4  # fp32 reduce input
    bare = replace(terms, pipeline_held_reduce_bytes_per_param=0.0)
    # the last stage: the root unit's (head, its tied copy) gradients; the first: the embedding's
    head = terms.post.params + terms.tied_params
    assert terms._first_backward_held_bytes(False, True) == pytest.approx(4 * head)
    assert terms._first_backward_held_bytes(True, False) == pytest.approx(4 * terms.pre.params)
    # never less than without it, and on a rank where that phase peaks, more by exactly the excess
    for rank in (0, 1):
        assert terms.rank_other_bytes(rank, 1, loss=False) >= bare.rank_other_bytes(rank, 1, loss=False)
    base = (terms.transient_bytes + terms.block.peak_bytes - terms.post.act_bytes + terms.root_grad_bytes
            + terms.root_bytes(False, True) + terms.stage_output_bytes
            + terms.config.num_microbatches * terms.pipeline_buffer_bytes)
    assert terms.rank_other_bytes(1, 1, loss=False) >= base + 4 * head - 1e-6 * base


@pytest.mark.parametrize("par", [
    {"dp": 8, "zero": 3},  # no pipeline: the final callback releases it after every backward
    {"dp": 2, "pp": 2, "zero": 1, "pp_schedule": "1f1b"},  # reduced once, after the last backward
    {"dp": 2, "pp": 2, "zero": 0, "pp_schedule": "1f1b"},  # replicate: likewise
])
def test_nothing_outlives_a_backward_elsewhere(par: dict) -> None:
    terms, _ = _terms(**par)
    assert terms.pipeline_held_reduce_bytes_per_param == 0.0
