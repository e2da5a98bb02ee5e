"""Expert parallelism under ``autopar rehearse``: on fake tensors there are no routing values to
count, so the dispatch sends the balanced split the cost model assumes (``routing_counts``) and the
rehearsal measures the plan instead of refusing it as a model that reads tensor values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.executor.parallel.expert_parallel import routing_counts

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"


def test_routing_counts_are_counted_on_real_tensors_and_balanced_on_fake_ones() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    ids = torch.tensor([0, 0, 3, 1, 0, 2, 3])
    assert routing_counts(ids, 4).tolist() == [3, 1, 1, 2]
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(ids)
        counts = routing_counts(fake, 4)
    assert counts.shape == (4,)
    assert routing_counts(torch.zeros(7, dtype=torch.long, device="meta"), 4).device.type == "meta"


def test_an_expert_parallel_plan_is_rehearsed(tmp_path: Path) -> None:
    from autopar.cluster import load_cluster
    from autopar.cost.estimate import estimate_plan
    from autopar.graph.measure import build_graph
    from autopar.plan import plan_from_dict
    from autopar.rehearse.compare import rehearse

    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(ZOO.parents[1] / "benchmarks"))
    import zoo_lib

    # HF Mixtral's stacked experts (its own expert code sorts the rows by expert without reading
    # a count; a plain loop over experts that asks which rows each got cannot be rehearsed)
    model = zoo_lib.with_size(ZOO / "hf_mixtral.py", "tiny", tmp_path)
    plan = plan_from_dict({
        "version": 1, "model": {"file": str(model), "num_blocks": 4},
        "cluster": {"profile": "cpu-local-2", "num_gpus": 2, "gpus_per_node": 2},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 32, "dtype": "bf16",
                     "optimizer": "adamw"},
        "parallel": {"dp": 2, "tp": 1, "pp": 1, "ep": 2, "zero": 1},
    })
    est = estimate_plan(plan, build_graph(str(model)), load_cluster("cpu-local-2"))
    (rank,) = rehearse(plan, str(model), est, "cpu-local-2", ranks=[0], workers=1).ranks
    rehearsed = rank.peak_bytes - rank.reserve_bytes
    assert rehearsed > 0
    assert rank.predicted_peak_bytes - rank.reserve_bytes == pytest.approx(rehearsed, rel=0.5)
