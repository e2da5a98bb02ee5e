"""The gradient noise scale and AdaScale on gloo ranks (executor/runtime/grad_norms.py, noise_scale.py, adascale.py).

The session's spawns of 2 and 4 ranks (tests/dist/shared.py) run every case in sequence on the least-squares model
(tests/dist/models/least_squares.py) with SGD:

* exact: each step's two squared norms -- the mean local one at B_small and the reduced one at
  B_big -- equal a single process's computed from the same rows (DDP, ZeRO-1/2/3 with gradient
  accumulation, tp 2, pp 2), and the losses are those of the same SGD run;
* statistical: at a learning rate too small to move the weights in the run, every plan measures
  the same B_simple; dp 2 and dp 4, tp 2 and pp 2 agree within their noise;
* AdaScale at 4 ranks (4x the batch) reaches one rank's loss at the same scale-invariant step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import HERE, Case
from harness import test_device as device_of
from shared import Job, result, share

pytestmark = pytest.mark.dist

LSQ = HERE / "models" / "least_squares.py"
SEED, LR = 7, 0.02
EXACT_STEPS, STAT_STEPS, STAT_LR = 4, 60, 1e-7
TARGET = 40.0  # AdaScale: scale-invariant steps to run


@dataclass(frozen=True, kw_only=True)
class LsqCase(Case):
    model: str = "lsq"
    steps: int = EXACT_STEPS
    lr: float = LR
    adascale: bool = False
    global_batch_size: int = 16

    def plan_dict(self) -> dict[str, Any]:
        par = {"dp": 1, "tp": 1, "pp": 1, **self.parallel}
        return {
            "version": 1,
            "model": {"file": str(LSQ), "num_blocks": 2},
            "cluster": {"profile": "a100-80g", "num_gpus": par["dp"] * par["tp"] * par["pp"], "gpus_per_node": 8},
            "training": {"global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
                         "seq_len": 1, "dtype": "fp32", "optimizer": "sgd"},
            "parallel": par,
        }


def _cases(prefix: str, parallel: dict[str, Any], mbs: int) -> list[LsqCase]:
    return [LsqCase(name=f"{prefix}-exact", parallel=parallel, micro_batch_size=mbs),
            LsqCase(name=f"{prefix}-stat", parallel=parallel, micro_batch_size=mbs, steps=STAT_STEPS, lr=STAT_LR)]


# tp 2 and pp 2 at dp 2 measure what dp 2 alone measures, step for step (the exact cases): their
# statistical agreement with dp 4 is dp 2's
CASES_2 = (_cases("ddp", {"dp": 2}, 4)
           + [LsqCase(name=f"zero{z}-exact", parallel={"dp": 2, "zero": z}, micro_batch_size=4) for z in (1, 2, 3)])
CASES_4 = (_cases("dp4", {"dp": 4}, 4)
           + [LsqCase(name="dp2xtp2-exact", parallel={"dp": 2, "tp": 2}, micro_batch_size=8),
              LsqCase(name="dp2xpp2-exact", parallel={"dp": 2, "pp": 2, "pp_schedule": "1f1b"}, micro_batch_size=4),
              LsqCase(name="adascale-dp4", parallel={"dp": 4}, micro_batch_size=4, global_batch_size=16,
                      steps=int(TARGET), adascale=True)])


def _run(_work_dir, case: LsqCase) -> dict | None:
    """Rank 0: the losses, the noise scale's history, AdaScale's record (and its final weights)."""
    from autopar.executor.parallel.apply import build_executable, full_parameters
    from autopar.executor.parallel.mesh import build_mesh
    from autopar.executor.runtime.checks import preflight
    from autopar.executor.runtime.train import AdaScaleOptions, train
    from autopar.modelfile import load_model_file

    plan = case.plan()
    mf = load_model_file(plan.model.file)
    spec, _ = preflight(plan, mf, dist.get_world_size())
    exe = build_executable(plan, mf, spec, build_mesh(plan, device_of()), seed=SEED, lr=case.lr, loss_fn=mf.loss_fn)
    run = train(exe, mf, steps=case.steps, seed=SEED, measure_noise=True,
                adascale=AdaScaleOptions(target_steps=TARGET) if case.adascale else None)
    params = full_parameters(exe) if case.adascale else None
    if dist.get_rank() != 0:
        return None
    noise = run.noise_scale
    return {"losses": list(run.losses), "noise": noise.to_json() if noise else None, "params": params,
            "adascale": run.adascale.to_json() if run.adascale else None}


# a Job per case, named as the case (the tests' parameter selects it)
JOBS = {c.name: Job(name=c.name, fn=_run, args=(c,)) for c in CASES_2 + CASES_4}
share(2, [JOBS[c.name] for c in CASES_2])
share(4, [JOBS[c.name] for c in CASES_4])


def _got(world: int, name: str) -> dict[str, Any]:
    got = result(world, JOBS[name])
    assert isinstance(got, list), f"{name} failed:\n{got}"
    return got[0]  # rank 0's


def _reference_norms(b_small: int, steps: int, lr: float, global_batch: int = 16, model_out: list | None = None,
                     data_seed: int = SEED) -> tuple[list, list]:
    """One process: per step, (mean |g|² over the B_small chunks of the global batch, |g|² of the
    whole batch), then an SGD step on the whole batch; and the losses. ``model_out``: gets the model."""
    from autopar.executor.parallel.host_reference import build_reference
    from autopar.modelfile import load_model_file

    mf = load_model_file(str(LSQ))
    model = build_reference(mf, SEED)
    params = list(model.parameters())
    norms, losses = [], []
    for step in range(steps):
        batch = mf.module.dataset(global_batch, step, data_seed)
        grads = []
        for chunk in batch.split(b_small):
            g = torch.autograd.grad(mf.loss_fn(model(chunk), chunk), params)
            grads.append(torch.cat([t.reshape(-1) for t in g]).double())
        big = torch.stack(grads).mean(0)
        norms.append((float(torch.stack([g.square().sum() for g in grads]).mean()), float(big.square().sum())))
        with torch.no_grad():
            losses.append(float(mf.loss_fn(model(batch), batch)))
            offset = 0
            for p in params:
                p -= lr * big[offset:offset + p.numel()].view_as(p).float()
                offset += p.numel()
    if model_out is not None:
        model_out.append(model)
    return norms, losses


def _excess_loss(model: torch.nn.Module) -> float:
    """Loss above the noise floor on 4,096 fresh rows: how far from the least-squares optimum."""
    from autopar.modelfile import load_model_file

    mf = load_model_file(str(LSQ))
    rows = mf.module.dataset(4096, 10**6, SEED)
    with torch.no_grad():
        return float(mf.loss_fn(model(rows), rows)) - 0.5 * mf.module.NOISE_STD**2


def _norms_of(noise: dict[str, Any]) -> list[tuple[float, float]]:
    """(small, big) per step back from the history's raw estimates: E|g_B|² = |G|² + tr(Σ)/B."""
    bs, bb = noise["b_small_samples"], noise["b_big_samples"]
    return [(h["grad_sq"] + h["trace_sigma"] / bs, h["grad_sq"] + h["trace_sigma"] / bb) for h in noise["history"]]


EXACT = [(2, c) for c in CASES_2 if c.name.endswith("exact")] + [(4, c) for c in CASES_4 if c.name.endswith("exact")]


@pytest.mark.parametrize(("world", "case"), EXACT, ids=[c.name for _, c in EXACT])
def test_norms_equal_one_process(world: int, case: LsqCase) -> None:
    got = _got(world, case.name)
    noise = got["noise"]
    # ZeRO-2/3 reduce per micro-batch: the local gradient is one micro-batch's
    per_micro = case.parallel.get("zero", 0) >= 2 and case.parallel.get("pp", 1) == 1
    assert noise["b_small_samples"] == (case.micro_batch_size if per_micro else 16 // case.parallel["dp"])
    assert noise["b_big_samples"] == 16 and noise["steps"] == case.steps
    ref, ref_losses = _reference_norms(noise["b_small_samples"], case.steps, case.lr)
    for step, ((small, big), (rs, rb)) in enumerate(zip(_norms_of(noise), ref)):
        assert small == pytest.approx(rs, rel=1e-4), f"step {step + 1}: mean local |g|²"
        assert big == pytest.approx(rb, rel=1e-4), f"step {step + 1}: reduced |g|²"
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-4)


def test_noise_scale_agrees_across_plans() -> None:
    """At fixed weights dp 2 and dp 4 estimate the same B_simple (from B_small 8 and 4), within 3
    standard errors judged from each run's own per-step estimates."""
    found = {}
    for world, prefix in ((2, "ddp"), (4, "dp4")):
        noise = _got(world, f"{prefix}-stat")["noise"]
        grad_sq = [h["grad_sq"] for h in noise["history"]]
        trace = [h["trace_sigma"] for h in noise["history"]]
        b = sum(trace) / sum(grad_sq)  # the whole run's ratio of means: fixed weights, a stationary problem
        n = len(grad_sq)
        rel_se = math.sqrt(_rel_var(trace) / n + _rel_var(grad_sq) / n)
        found[prefix] = (b, rel_se)
        assert noise["b_simple"] is not None and noise["b_simple"] > 0, prefix
    dp2, dp4 = found["ddp"], found["dp4"]
    assert abs(math.log(dp2[0] / dp4[0])) <= 3 * math.hypot(dp2[1], dp4[1]), found


def _rel_var(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / mean**2


def test_adascale_reaches_one_rank_loss_at_the_same_scale_invariant_step() -> None:
    """4 ranks at 4x the batch under AdaScale, run to TARGET scale-invariant steps, end at least as
    close to the optimum as one rank at scale 1 after TARGET steps (on average over its data
    streams) -- where as many 4-rank steps at scale 1's learning rate are far behind."""
    from autopar.executor.parallel.host_reference import build_reference
    from autopar.modelfile import load_model_file

    got = _got(4, "adascale-dp4")
    ada = got["adascale"]
    assert ada["scale"] == 4 and ada["scale_invariant_steps"] >= TARGET - 1e-9
    assert all(1.0 <= g <= 4.0 for g in ada["gains"])
    steps = len(got["losses"])
    assert steps < TARGET, "a gain above 1 takes fewer steps than the target"
    model = build_reference(load_model_file(str(LSQ)), SEED)
    model.load_state_dict(got["params"])
    adascale = _excess_loss(model)
    # scale 1 (one rank, batch 4) for TARGET steps, and 4x the batch for as many steps as AdaScale
    # took at scale 1's learning rate: each averaged over data streams (one SGD path is noisy)
    one_rank: list = []
    unscaled: list = []
    for data_seed in range(SEED, SEED + 8):
        _reference_norms(4, int(TARGET), LR, global_batch=4, model_out=one_rank, data_seed=data_seed)
        _reference_norms(16, steps, LR, global_batch=16, model_out=unscaled, data_seed=data_seed)
    one = sum(map(_excess_loss, one_rank)) / len(one_rank)
    plain = sum(map(_excess_loss, unscaled)) / len(unscaled)
    # reached: at least as close to the optimum (its 4x batch also has a lower noise floor) ...
    assert adascale <= 1.3 * one, (adascale, one, plain)
    # ... where the same steps without the gain are far behind
    assert plain > 2 * one, (adascale, one, plain)
