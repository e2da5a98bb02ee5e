"""For models of every structure the zoo holds, each dimension is one decision: "the search offers
it" <=> "estimate accepts a plan using it" <=> "the executor's preflight accepts that plan", and where
they refuse, preflight and the search give the model's one reason (autopar.spec.support). Expert
parallelism has its own test over the mixture-of-experts models (test_ep_support.py)."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import zoo_lib  # noqa: E402

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# one model per structure: two towers, stages of growing width, blocks of two structures, encoder +
# decoder, a state-space model, a conv chain, a ViT in an nn.Sequential, Conv1D layers
MODELS = ["hf_clip", "hf_swin", "hf_modernbert", "hf_whisper", "hf_mamba2", "resnet", "vit", "hf_gpt2"]
# dimension -> the parallel section of a 2-GPU plan that uses it
PLANS = {
    "tp": {"tp": 2},
    "sp": {"tp": 2, "sequence_parallel": True},
    "pp": {"pp": 2},
    "cp": {"cp": 2, "cp_kind": "allgather"},
    "zero3": {"dp": 2, "zero": 3},
}


def _offered(graph, mf, dim: str) -> bool:
    from autopar.search.space import SearchSpace, enumerate_branches

    space = SearchSpace(num_gpus=2, gpus_per_node=8, global_batch=4, seq_len=mf.seq_len or 1, micro_batches=(1,))
    branches = list(enumerate_branches(graph, space, Counter()))
    used = {"tp": lambda b: b.tp > 1, "sp": lambda b: b.sequence_parallel, "pp": lambda b: b.pp > 1,
            "cp": lambda b: b.cp > 1, "zero3": lambda b: 3 in b.zero_stages}[dim]
    return any(used(b) for b in branches)


def _plan(mf, num_blocks: int, parallel: dict):
    from autopar.plan import plan_from_dict

    return plan_from_dict({
        "version": 1, "model": {"file": str(mf.path), "num_blocks": num_blocks},
        "cluster": {"profile": "a100-80g", "num_gpus": 2, "gpus_per_node": 8},
        "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": mf.seq_len or 1, "dtype": "bf16",
                     "optimizer": "adamw"},
        "parallel": {"dp": 1, "tp": 1, "pp": 1, **parallel},
    })


@pytest.mark.parametrize("name", MODELS)
def test_offered_equals_estimate_accepts_equals_preflight_accepts(name, tmp_path):
    if name.startswith("hf_") and not HAS_TRANSFORMERS:
        pytest.skip("transformers not installed")
    from autopar.cost.estimate import check_plan_against_model
    from autopar.errors import AutoparError
    from autopar.executor.runtime.checks import preflight
    from autopar.graph import build_graph
    from autopar.modelfile import load_model_file
    from autopar.plan import PlanError
    from autopar.spec import model_spec

    mf = load_model_file(zoo_lib.with_size(zoo_lib.zoo_models([name])[0].path, "tiny", tmp_path))
    spec, graph = model_spec(mf), build_graph(mf)
    for dim, parallel in PLANS.items():
        reason = spec.support_reason(dim)
        try:
            plan = _plan(mf, spec.num_blocks, parallel)
        except PlanError:  # cp 2 of a model without a sequence: not even a plan
            assert not _offered(graph, mf, dim) and reason, (name, dim)
            continue
        # the reason a refusal gives: the first dimension this plan uses that the model refuses (sp's plan uses tp)
        first = next((spec.support_reason(d) for d, used, _ in plan.dimensions_used()
                      if used and spec.support_reason(d)), None)
        verdicts = {"offered": _offered(graph, mf, dim)}
        for who, check in (("estimate", lambda: check_plan_against_model(plan, graph)),
                           ("preflight", lambda: preflight(plan, mf, world_size=2))):
            try:
                check()
                verdicts[who] = True
            except AutoparError as exc:
                verdicts[who] = False
                assert first is not None and first in str(exc), (name, dim, who, str(exc), first)
        assert len(set(verdicts.values())) == 1, (name, dim, verdicts, reason)
        assert verdicts["offered"] == (reason is None), (name, dim, reason)
