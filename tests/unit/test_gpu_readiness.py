"""What would break on a GPU, guarded on CPU: fp16 without loss scaling is refused before any rank
starts; a rank's out-of-memory ends in one line (tests/dist/test_fault_cli.py runs it end to end)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.errors import EXIT_OUT_OF_MEMORY, AutoparError, OutOfDeviceMemory
from autopar.executor.checks import preflight
from autopar.executor.rank_main import out_of_memory
from autopar.modelfile import load_model_file
from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training

SMALL = Path(__file__).resolve().parents[2] / "examples" / "gpt_small.py"


def _plan(dtype: str, pp: int = 1, prediction: dict | None = None) -> Plan:
    return Plan(model=ModelRef(file=str(SMALL), num_blocks=8), cluster=ClusterRef(profile="cpu-local-2", num_gpus=pp,
                                                                                gpus_per_node=8),
                training=Training(global_batch_size=8, micro_batch_size=1, seq_len=128, dtype=dtype, optimizer="adam"),
                parallel=Parallel(dp=1, tp=1, pp=pp), prediction=prediction)


@pytest.mark.parametrize("pp", [1, 2])
def test_fp16_is_refused_at_every_pipeline_depth(pp: int) -> None:
    with pytest.raises(AutoparError, match="fp16 needs loss scaling"):
        preflight(_plan("fp16", pp), load_model_file(SMALL), pp)
    preflight(_plan("bf16", pp), load_model_file(SMALL), pp)  # bf16 is fine


def test_out_of_memory_line_names_the_rank_the_step_and_the_priced_peak() -> None:
    plan = _plan("bf16", prediction={"peak_memory_bytes": 78 * 2**30, "capacity_bytes": 79.18 * 2**30})
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")
    err = out_of_memory(3, "step 7", exc, plan, "plans/p.yaml")
    assert isinstance(err, OutOfDeviceMemory) and err.exit_code == EXIT_OUT_OF_MEMORY == 3
    line = str(err)
    assert "rank 3 ran out of device memory in step 7 (CUDA out of memory. Tried to allocate 2.00 GiB)" in line
    assert "priced at 78.0 of 79.2 GiB" in line and "autopar rehearse plans/p.yaml" in line and "\n" not in line
