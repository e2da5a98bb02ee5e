"""The gradient noise scale's estimators (executor/runtime/noise_scale.py) and AdaScale's gain (executor/runtime/adascale.py),
without ranks: a least-squares problem whose gradient noise is known in closed form, and FairScale's
own AdaScale (an optional test dependency) on identical per-worker gradients."""

from __future__ import annotations

import math

import pytest
import torch

from autopar.executor.runtime.adascale import AdaScale, gain_ratio, scaled_lr
from autopar.executor.runtime.noise_scale import NoiseScaleEstimator, NormSample, b_simple_of, estimate


def _least_squares_norms(steps: int, workers: int, b_small: int, dim: int, r_sq: float, noise: float, seed: int = 0):
    """Per-sample loss ½ (xᵀθ − y)², x ~ N(0, I), y = xᵀθ* + noise·ε, at fixed r = θ − θ*: the
    per-sample gradient x (xᵀr − noise·ε) has mean r and covariance (|r|² + noise²) I + r rᵀ, so
    |G|² = |r|² and tr(Σ) = d (|r|² + noise²) + |r|². Yields each step's NormSample."""
    g = torch.Generator().manual_seed(seed)
    r = torch.full((dim,), math.sqrt(r_sq / dim), dtype=torch.float64)
    for _ in range(steps):
        x = torch.randn(workers, b_small, dim, generator=g, dtype=torch.float64)
        eps = torch.randn(workers, b_small, generator=g, dtype=torch.float64)
        grads = x * (x @ r - noise * eps)[..., None]  # per sample
        local = grads.mean(1)  # each worker's gradient at B_small
        yield NormSample(small_sq=float(local.square().sum(-1).mean()), big_sq=float(local.mean(0).square().sum()),
                         b_small_samples=b_small, b_big_samples=workers * b_small)


def test_recovers_b_simple_of_least_squares() -> None:
    dim, r_sq, noise = 16, 1.0, 1.0
    true = (dim * (r_sq + noise**2) + r_sq) / r_sq  # 33 samples
    est = NoiseScaleEstimator(decay=0.999)  # a long window: the figure, not its tracking, is tested
    for step, sample in enumerate(_least_squares_norms(3000, workers=4, b_small=8, dim=dim, r_sq=r_sq, noise=noise)):
        est.update(step + 1, sample)
    assert est.b_simple == pytest.approx(true, rel=0.10)
    rep = est.report()
    assert rep.steps == 3000 and (rep.b_small_samples, rep.b_big_samples) == (8, 32)
    assert rep.grad_sq == pytest.approx(r_sq, rel=0.15) and rep.trace_sigma == pytest.approx(true * r_sq, rel=0.10)


def test_estimators_are_exact_on_expected_norms() -> None:
    """E|G_B|² = |G|² + tr(Σ)/B at both sizes gives back |G|² and tr(Σ) exactly."""
    g2, tr = 2.5, 40.0
    est = estimate(NormSample(small_sq=g2 + tr / 4, big_sq=g2 + tr / 64, b_small_samples=4, b_big_samples=64))
    assert est.grad_sq == pytest.approx(g2) and est.trace_sigma == pytest.approx(tr)


def test_unknown_b_simple_is_none_and_json_is_finite() -> None:
    assert b_simple_of(-1.0, 3.0) is None and b_simple_of(0.0, 3.0) is None and b_simple_of(1.0, math.nan) is None
    est = NoiseScaleEstimator()
    est.update(1, NormSample(small_sq=1.0, big_sq=2.0, b_small_samples=2, b_big_samples=4))  # |G|² > 0, tr(Σ) < 0
    data = est.report().to_json()
    assert data["b_simple"] is None and data["steps"] == 1 and data["history"][0]["step"] == 1
    with pytest.raises(ValueError):
        NormSample(small_sq=1.0, big_sq=1.0, b_small_samples=4, b_big_samples=4)


def test_gain_ratio_lies_in_one_to_scale() -> None:
    g = torch.Generator().manual_seed(1)
    for scale in (2.0, 4.0, 64.0):
        ada = AdaScale(scale=scale, unit_batch_samples=2)
        for step in range(200):
            small, big = torch.rand(2, generator=g, dtype=torch.float64).tolist()
            sample = NormSample(small_sq=10 * small, big_sq=10 * big, b_small_samples=2, b_big_samples=int(2 * scale))
            gain = ada.update(step + 1, sample).gain
            assert 1.0 - 1e-12 <= gain <= scale + 1e-12
    assert gain_ratio(1e-6, 0.0, 8.0) == pytest.approx(8.0) and gain_ratio(1.0, 1e9, 8.0) == pytest.approx(1.0)


def test_gain_equals_fairscale_on_identical_worker_gradients() -> None:
    """S per-worker gradients fed to FairScale's AdaScale (one process accumulating S scaled
    backward passes: its local squares are the S workers') and to autopar's (the mean local and the
    reduced squared norm): the same gain at every step."""
    fairscale = pytest.importorskip("fairscale.optim")
    scale, dim = 4, 6
    p = torch.nn.Parameter(torch.zeros(dim, dtype=torch.float64))
    theirs = fairscale.AdaScale(torch.optim.SGD([p], lr=0.1), world_size=1, num_gradients_to_accumulate=scale)
    ours = AdaScale(scale=scale, unit_batch_samples=1)
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(dim, generator=g, dtype=torch.float64)
    for step in range(12):
        worker = mean + (0.3 + step / 4) * torch.randn(scale, dim, generator=g, dtype=torch.float64)
        theirs.zero_grad()
        for w in worker:
            ((p * w).sum() / scale).backward()  # loss scaled by the accumulation, FairScale's default
        sample = NormSample(small_sq=float(worker.square().sum(1).mean()), big_sq=float(worker.mean(0).square().sum()),
                            b_small_samples=1, b_big_samples=scale)
        assert ours.update(step + 1, sample).gain == pytest.approx(theirs.gain(), rel=1e-6), step  # its sums are fp32
        theirs.step()
    theirs.unhook()


def test_scaled_lr_scales_one_step_and_restores() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    p.grad = torch.ones(2)
    with scaled_lr(opt, 3.0):
        assert opt.param_groups[0]["lr"] == 1.5
        opt.step()
    assert opt.param_groups[0]["lr"] == 0.5
    assert p.detach().tolist() == pytest.approx([1 - 1.5, 1 - 1.5])


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"adascale": True, "adascale_target": -1.0}, "--adascale-target must be a positive"),
    ({"adascale": True, "adascale_target": math.inf}, "--adascale-target must be a positive"),
    ({"adascale_target": 10.0}, "--adascale-target needs --adascale"),
    ({"adascale_force": True}, "--adascale-force needs --adascale"),
    ({"adascale": True, "checkpoint_dir": "ck"}, "does not checkpoint"),
])
def test_adascale_options_refused(kwargs: dict, needle: str) -> None:
    from autopar.errors import AutoparError
    from autopar.executor.runtime.run_options import RunOptions

    with pytest.raises(AutoparError, match=needle):
        RunOptions(plan_path="p.yaml", **kwargs)


def test_adascale_target_bounds_the_steps() -> None:
    from autopar.executor.runtime.run_options import RunOptions

    assert RunOptions(plan_path="p.yaml", steps=3, adascale=True, adascale_target=7.5).step_limit == 8
    assert RunOptions(plan_path="p.yaml", steps=3).step_limit == 3
