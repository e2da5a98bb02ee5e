"""Leave-one-source-out validation of the H100 constants fitted to published runs.

The H100 profiles carry a few efficiencies that no datasheet gives and that were chosen against
the runs of calibration/h100_public.yaml (``FITTED``): the GEMMs' best fraction of peak, each
software's fused attention efficiency and the share of an overlapped collective's time that still
costs. An error measured on the runs those constants were chosen on says little about a run they
were not; so, for each public source in turn, every fitted constant is re-derived from the other
sources' runs alone (``fit``) and the left-out source's runs are predicted with them
(``holdout``). That held-out error is the accuracy to state.

The fit minimises the mean squared relative step-time error (predicted / published - 1) over its
runs (Levenberg-Marquardt from the shipped values, inside each constant's physical bounds). A
constant that no remaining run depends on (its profile priced none of them) cannot be re-derived:
it keeps its shipped value and the fold says so (``Fold.kept``), its held-out figure then
optimistic for that constant. torchtitan's runs ran on a 500 W part of
unknown clocks (reference_h100): they are predicted in every fold, never fitted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from autopar.cluster import Cluster
from autopar.reference_h100 import PublicRun, public_plan, public_runs, run_graph, software_cluster

SOURCES = ("dgxc", "megatron_core_r08", "llm_foundry")  # fitted and held out in turn
PREDICTED_ONLY = ("torchtitan",)  # other hardware: predicted with each fold's constants, never fitted


@dataclass(frozen=True, kw_only=True)
class FittedConstant:
    """One profile constant chosen against published runs: its name, the profiles it sits in, its
    physical bounds, and how a cluster takes a value of it."""

    name: str
    profiles: tuple[str, ...]
    low: float
    high: float
    get: Callable[[Cluster], float]
    put: Callable[[Cluster, float], Cluster]


def _gemm_max(c: Cluster, v: float) -> Cluster:
    return dataclasses.replace(c, gemm=dataclasses.replace(c.gemm, max=v))


def _field(name: str) -> tuple[Callable[[Cluster], float], Callable[[Cluster, float], Cluster]]:
    return (lambda c: getattr(c, name)), (lambda c, v: dataclasses.replace(c, **{name: v}))


FITTED = (
    # the hardware's: one value for every software on it (h100-80g-megatron inherits h100-80g's)
    FittedConstant(name="gemm_max", profiles=("h100-80g", "h100-80g-megatron"), low=0.55, high=0.95,
                   get=lambda c: c.gemm.max, put=_gemm_max),
    FittedConstant(name="attention (torch flash)", profiles=("h100-80g",), low=0.15, high=0.75,
                   get=_field("attention_efficiency")[0], put=_field("attention_efficiency")[1]),
    FittedConstant(name="attention (TE cuDNN)", profiles=("h100-80g-megatron",), low=0.15, high=0.75,
                   get=_field("attention_efficiency")[0], put=_field("attention_efficiency")[1]),
    FittedConstant(name="overlap cost (FSDP2)", profiles=("h100-80g",), low=0.0, high=0.9,
                   get=_field("overlap_cost_fraction")[0], put=_field("overlap_cost_fraction")[1]),
    FittedConstant(name="overlap cost (Megatron)", profiles=("h100-80g-megatron",), low=0.0, high=0.9,
                   get=_field("overlap_cost_fraction")[0], put=_field("overlap_cost_fraction")[1]),
)

ITERATIONS = 30
FD_STEP = 1e-3  # of a constant's bounds: the forward difference of the Jacobian


@dataclass(frozen=True, kw_only=True)
class _Row:
    run: PublicRun
    profile: str
    base: Cluster  # the run's software profile with its stated settings (software_cluster)
    plan: object
    graph: object


def _rows(runs: Sequence[PublicRun]) -> list[_Row]:
    out = []
    for run in runs:
        cluster, profile = software_cluster(run)
        out.append(_Row(run=run, profile=profile, base=cluster, plan=public_plan(run, profile), graph=run_graph(run)))
    return out


def shipped_values() -> dict[str, float]:
    """Each fitted constant's value in the shipped profiles."""
    from autopar.cluster import load_cluster

    return {k.name: k.get(load_cluster(k.profiles[-1])) for k in FITTED}


def _cluster(row: _Row, values: dict[str, float]) -> Cluster:
    c = row.base
    for k in FITTED:
        if row.profile in k.profiles:
            c = k.put(c, values[k.name])
    return c


def errors(rows: Sequence[_Row], values: dict[str, float]) -> list[float]:
    """Signed step-time error (predicted / published - 1) of each row under ``values``."""
    from autopar.cost.estimate import estimate_plan

    return [estimate_plan(r.plan, r.graph, _cluster(r, values)).step_time_s / r.run.step_time_s - 1 for r in rows]


def fit(rows: Sequence[_Row], start: dict[str, float], *, iterations: int = ITERATIONS) -> tuple[dict[str, float],
                                                                                         tuple[str, ...]]:
    """(constants fitted to ``rows`` from ``start``, the names no row depends on: kept at ``start``).

    Least squares on the rows' relative errors r_i (predicted / published - 1) by Levenberg-Marquardt
    over the free constants, each scaled to its bounds: the Jacobian J by forward differences, the
    step (J^T J + lambda diag(J^T J)) d = -J^T r clipped to the bounds, lambda shrinking after a step
    that lowers sum r_i^2 and growing after one that does not."""
    import numpy as np

    used = {r.profile for r in rows}
    free = [k for k in FITTED if used & set(k.profiles)]
    kept = tuple(k.name for k in FITTED if k not in free)
    lo = np.array([k.low for k in free])
    span = np.array([k.high - k.low for k in free])

    def residuals(x: "np.ndarray") -> "np.ndarray":
        values = {**start, **{k.name: float(v) for k, v in zip(free, lo + span * x)}}
        return np.array(errors(rows, values))

    x = np.clip((np.array([start[k.name] for k in free]) - lo) / span, 0.0, 1.0)
    r = residuals(x)
    damping = 1e-2
    for _ in range(iterations):
        jac = np.empty((len(r), len(free)))
        for j in range(len(free)):
            h = FD_STEP if x[j] + FD_STEP <= 1.0 else -FD_STEP
            step = x.copy()
            step[j] += h
            jac[:, j] = (residuals(step) - r) / h
        normal = jac.T @ jac
        grad = jac.T @ r
        while damping < 1e6:
            d = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -grad)
            trial = np.clip(x + d, 0.0, 1.0)
            r_trial = residuals(trial)
            if r_trial @ r_trial < r @ r:
                x, r, damping = trial, r_trial, max(damping / 10, 1e-7)
                break
            damping *= 10
        else:
            break  # no step lowers the squares: a minimum within the bounds
    return {**start, **{k.name: float(v) for k, v in zip(free, lo + span * x)}}, kept


@dataclass(frozen=True, kw_only=True)
class Fold:
    """One source left out: the constants fitted without it, its runs' errors with the shipped
    constants (in-sample) and with the refitted ones (held-out), and the constants kept."""

    source: str
    values: dict[str, float]
    kept: tuple[str, ...]
    in_sample: tuple[float, ...]
    held_out: tuple[float, ...]
    names: tuple[str, ...]


def holdout(sources: Sequence[str] = SOURCES, progress: Callable[[str], None] | None = None) -> list[Fold]:
    """Each source of ``sources`` left out in turn (module docstring); torchtitan's rows follow, predicted
    with the constants fitted on every source."""
    shipped = shipped_values()
    by_source = {s: _rows(public_runs(s)) for s in (*sources, *PREDICTED_ONLY)}
    folds = []
    for source in (*sources, *PREDICTED_ONLY):
        if progress:
            progress(f"fitting without {source}")
        train = [r for s in sources if s != source for r in by_source[s]]
        values, kept = fit(train, shipped)
        test = by_source[source]
        folds.append(Fold(source=source, values=values, kept=kept, in_sample=tuple(errors(test, shipped)),
                          held_out=tuple(errors(test, values)), names=tuple(r.run.name for r in test)))
    return folds
