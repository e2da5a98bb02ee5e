"""Shared fixtures of the planner unit tests (pure CPU, meta device, no torch.distributed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def a100():
    from autopar.cluster import load_cluster

    return load_cluster("a100-80g")


@pytest.fixture(scope="session")
def a100_megatron():
    """The A100 under Megatron-LM's software, the runs Korthikanti et al. and SC21 measured."""
    from autopar.cluster import load_cluster

    return load_cluster("a100-80g-megatron")


@pytest.fixture(scope="session")
def small_gpt():
    """A 16-layer GPT small enough to estimate in milliseconds; its blocks dominate the embedding
    and head (vocab 512), so pipeline stages are close to uniform."""
    from autopar.models.gpt import GPTConfig
    from autopar.reference import gpt_graph

    return gpt_graph(GPTConfig(num_layers=16, hidden_size=1024, num_heads=16, seq_len=1024, vocab_size=512), "bf16")


@pytest.fixture(scope="session")
def make_plan() -> Callable[..., Any]:
    """make_plan(num_blocks, global_batch_size=..., micro_batch_size=..., seq_len=..., **parallel) -> Plan,
    with cluster.num_gpus = dp*tp*pp*cp on 8-GPU a100-80g nodes."""
    from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training

    def make(num_blocks: int, *, global_batch_size: int = 64, micro_batch_size: int = 1, seq_len: int = 1024,
             dtype: str = "bf16", **parallel: Any) -> Plan:
        n = parallel.get("dp", 1) * parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1)
        parallel.setdefault("dp", 1)
        parallel.setdefault("tp", 1)
        parallel.setdefault("pp", 1)
        return Plan(
            model=ModelRef(file="model.py", num_blocks=num_blocks),
            cluster=ClusterRef(profile="a100-80g", num_gpus=n, gpus_per_node=8),
            training=Training(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                              seq_len=seq_len, dtype=dtype, optimizer="adam"),
            parallel=Parallel(**parallel),
        )

    return make


@pytest.fixture(scope="session")
def make_config() -> Callable[..., Any]:
    """make_config(**overrides) -> autopar.cost.stage.Config (defaults: one GPU, b=1, s=2048, fp16, Adam)."""
    from autopar.cost.stage import Config

    def make(**kw: Any) -> Config:
        base = dict(dp=1, tp=1, pp=1, cp=1, cp_kind="ring", sequence_parallel=False, zero=0, recompute="none",
                    schedule="1f1b", virtual_stages=1, micro_batch=1, global_batch=1, seq_len=2048,
                    dtype_bytes=2, optimizer="adam")
        base.update(kw)
        if "global_batch" not in kw:
            base["global_batch"] = base["micro_batch"] * base["dp"]
        return Config(**base)

    return make
