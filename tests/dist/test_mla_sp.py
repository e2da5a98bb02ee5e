"""Replicated parameters inside tensor-parallel blocks are placed by the block's data flow
(spec/tp_replicated.py, executor/parallel/tp_replicated.py) and train like one rank, with and without
Megatron sequence parallelism, on 2 gloo ranks: every step's loss (rel 1e-4, 3 steps) and each
parameter's step-1 gradient, norm by norm (rel 1e-4: a doubled or halved gradient shows only there).

- DeepSeek (multi-head latent attention): ``q_a_proj -> q_a_layernorm -> q_b_proj`` and
  ``kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj``, the first two of each chain replicated and
  computing on the whole (under SP: all-gathered) input, so every rank holds their full gradient;
  the shared rotary key summed at ``kv_a_proj_with_mqa``'s output (TPPlan.grad_sums). The zoo's
  DeepSeek-V3 (a chain: a dense layer, then MoE layers whose experts route the sequence shard under
  SP) and a dense DeepSeek-V2 whose ``q_proj`` is colwise beside the replicated ``kv_a_proj_with_mqa``
  (the gathered input's gradient adds both).
- Gemma 3: ``q_norm``/``k_norm`` on each rank's heads, whose gradient is summed over tp with or
  without SP (without SP it was each rank's heads' share alone: 40 % off).

Two controls run the old rule and show the comparison fails where it should: SP summing every norm
(DeepSeek-V2's ``kv_a_layernorm`` gradient doubled) and tp without SP summing none (Gemma 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from harness import ZOO, Case, _run_case, reference_for  # noqa: E402
from shared import Job, result, share  # noqa: E402

pytestmark = pytest.mark.dist

FILES = {"hf-deepseek-v3": ZOO / "hf_deepseek_v3.py", "hf-gemma3": ZOO / "hf_gemma3.py",
         "deepseek-v2-dense": Path(__file__).resolve().parent / "models" / "deepseek_v2_dense.py"}
SEQ = {"hf-deepseek-v3": 32, "hf-gemma3": 64, "deepseek-v2-dense": 32}


@dataclass(frozen=True, kw_only=True)
class FlowCase(Case):
    """A harness Case on one of FILES (picklable: spawned workers import this module)."""

    def plan_dict(self) -> dict[str, Any]:
        par = {"dp": 1, "tp": 1, "pp": 1, **self.parallel}
        return {
            "version": 1,
            "model": {"file": str(FILES[self.model]), "num_blocks": 4},
            "cluster": {"profile": "a100-80g", "num_gpus": par["tp"], "gpus_per_node": 8},
            "training": {"global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
                         "seq_len": SEQ[self.model], "dtype": "fp32", "optimizer": "adamw"},
            "parallel": par,
        }


TP, SP = {"tp": 2}, {"tp": 2, "sequence_parallel": True}
CASES = [FlowCase(name=f"{m}-tp2{'-sp' if par is SP else ''}", model=m, parallel=par)
         for m in FILES for par in (SP, TP)]


def _old_rule(block, plan, sequence_parallel):  # noqa: ANN001, ANN202 - tensor_parallel's call
    """The rule before the data flow was read: every norm summed under SP, none without."""
    from autopar.spec.sp_check import is_norm

    return tuple(n for n, m in block.named_modules() if n and is_norm(m)) if sequence_parallel else ()


def _with_old_rule(work_dir: Path, case: FlowCase) -> dict | None:
    from autopar.executor.parallel import tp_replicated

    rule = tp_replicated.summed_norms
    tp_replicated.summed_norms = _old_rule
    try:
        _run_case(case, work_dir)
    finally:
        tp_replicated.summed_norms = rule
    import torch.distributed as dist

    return torch.load(work_dir / f"{case.name}.pt") if dist.get_rank() == 0 else None


CONTROLS = [FlowCase(name="old-rule-deepseek-v2-dense-tp2-sp", model="deepseek-v2-dense", parallel=SP),
            FlowCase(name="old-rule-hf-gemma3-tp2", model="hf-gemma3", parallel=TP)]
JOBS = [Job(name=f"{c.name}-job", fn=_with_old_rule, args=(c,)) for c in CONTROLS]
share(2, CASES + JOBS)


def _worst_norm(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest relative difference of a parameter's gradient norm from one rank's, and its name."""
    floor = 1e-3 * max(float(g.norm()) for g in ref.values())
    return max((abs(float(got[n].norm()) - float(r.norm())) / max(float(r.norm()), floor), n) for n, r in ref.items())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_replicated_parameters_train_like_one_rank(case: FlowCase) -> None:
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    spec = model_spec(load_model_file(FILES[case.model]))
    for dim in ("tp", "sp") if case.parallel.get("sequence_parallel") else ("tp",):
        assert spec.support_reason(dim) is None, f"{dim} is not offered: {spec.support_reason(dim)}"
    got = result(2, case)
    assert isinstance(got, dict), f"{case.name} failed:\n{got}"
    ref_losses, _, ref_grads = reference_for(case)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-4)
    assert set(got["grads"]) == set(ref_grads)
    worst, name = _worst_norm(got["grads"], ref_grads)
    assert worst < 1e-4, f"step-1 gradient norm of {name} off by {worst:.1e}"
    for n, ref in ref_grads.items():
        torch.testing.assert_close(got["grads"][n], ref, rtol=1e-3, atol=1e-4 * float(ref.abs().max()) + 1e-7,
                                   msg=lambda m, n=n: f"grad {n}: {m}")


@pytest.mark.parametrize("job", JOBS, ids=lambda j: j.name)
def test_the_old_rule_fails_the_comparison(job: Job) -> None:
    case = job.args[0]
    got = result(2, job)
    assert isinstance(got, list) and isinstance(got[0], dict), f"{case.name} failed:\n{got}"
    _, _, ref_grads = reference_for(case)
    worst, name = _worst_norm(got[0]["grads"], ref_grads)
    assert worst > 0.1, f"the old rule trained like one rank (worst {name}: {worst:.1e})"
    ratio = float(got[0]["grads"][name].norm()) / float(ref_grads[name].norm())
    if case.parallel.get("sequence_parallel"):  # a whole-input norm summed over 2 ranks: twice its gradient
        assert "kv_a_layernorm" in name and ratio == pytest.approx(2.0, rel=1e-3), (name, ratio)
    else:  # a per-head norm left unsummed: one rank's heads' share
        assert "_norm" in name and ratio < 0.9, (name, ratio)
