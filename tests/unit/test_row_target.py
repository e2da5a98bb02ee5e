"""The pipeline's row target stays on the host (GPU readiness, M11): the last stage's loss reads each
micro-batch's first and last row index, and on a GPU reading them off the device synchronized the
stream once per micro-batch, exposing the launch latency the CPU's run-ahead hides."""

from __future__ import annotations

import torch

from autopar.executor.parallel.pipeline_parallel import StepIO


def test_row_target_is_a_host_tensor_of_the_rows() -> None:
    batch = {"input_ids": torch.zeros(6, 16, dtype=torch.long, device="meta")}  # wherever the batch lives
    target = StepIO.row_target(batch)
    assert target.device.type == "cpu" and target.tolist() == list(range(6))
    assert [t.tolist() for t in torch.tensor_split(target, 3)] == [[0, 1], [2, 3], [4, 5]]  # as the schedule splits it
