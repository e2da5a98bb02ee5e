"""The planner's best plan against every published recipe of the calibration set: for the same model, GPUs,
global batch, sequence and software, is the searched best ever predicted slower than the recipe, and where
it is predicted much faster, where does the time go?

    python benchmarks/plan_quality.py             # every H100 recipe and Megatron SC21's A100 rows
    python benchmarks/plan_quality.py --groups dgxc  # one group (dgxc, dgxc_llama31, megatron_core_r08, llm_foundry, torchtitan, sc21)

Each recipe is priced as benchmarks/calibration.py prices it (its software's profile with the run's own
settings); the search runs on that same priced cluster, among the plans the recipe's engine runs (Megatron-Core
runs and Megatron-LM's SC21 rows: ``--engine megatron``; PyTorch FSDP runs: everything ``autopar run`` runs), with the
recipe's own micro-batch
among those searched. A best plan more than 10 % faster gets a line saying which terms of the step shrink.
Prints one table; exit 1 if a best plan is predicted slower than its recipe (the search missed a plan it
should have found).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopar import api  # noqa: E402
from autopar.engines.capability import get_engine, search_knobs  # noqa: E402
from autopar.reference import gpt_model_path, megatron_plan, megatron_rows, sc21_cluster  # noqa: E402
from autopar.reference_h100 import model_path, public_plan, public_runs, software_cluster  # noqa: E402
from autopar.report import plan_brief, table  # noqa: E402
from autopar.search.driver import search_plans  # noqa: E402

MUCH_FASTER = 0.10  # a best plan this much faster than the recipe gets a line on where the time goes


def where_time_goes(recipe: dict[str, float], best: dict[str, float]) -> str:
    """The terms of the step that shrink (or grow) most from the recipe to the best plan."""
    keys = sorted(set(recipe) | set(best), key=lambda k: -abs(recipe.get(k, 0.0) - best.get(k, 0.0)))
    moves = [f"{k} {recipe.get(k, 0.0):.2f} -> {best.get(k, 0.0):.2f} s" for k in keys[:3]
             if abs(recipe.get(k, 0.0) - best.get(k, 0.0)) > 0.005 * sum(recipe.values())]
    return ", ".join(moves)


def cases(groups: set[str]) -> list[tuple]:
    """(group, name, model file, plan, priced cluster, engine) of every recipe asked for."""
    out = []
    for run in public_runs():
        if run.group in groups:
            cluster, profile = software_cluster(run)
            out.append((run.group, run.name, str(model_path(run.model)), public_plan(run, profile), cluster,
                        "megatron" if run.software == "megatron" else "autopar"))
    if "sc21" in groups:
        for row in megatron_rows():  # Megatron-LM's own runs, on the A100 profile with the software they used
            out.append(("sc21", f"gpt-{row.params_billion:g}b", str(gpt_model_path(row.config)), megatron_plan(row),
                        sc21_cluster(), "megatron"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="dgxc,dgxc_llama31,megatron_core_r08,llm_foundry,torchtitan,sc21")
    args = ap.parse_args()
    start = time.perf_counter()
    rows, notes, slower = [], [], []
    for group, name, model, plan, cluster, engine in cases(set(args.groups.split(","))):
        t0 = time.perf_counter()
        recipe = api.estimation(model, plan, cluster, warn=lambda m: None).estimate
        tr = plan.training
        knobs = {**search_knobs(get_engine(engine), {}, None), "moe_imbalance": 1.0}
        found = search_plans(model, gpus=plan.cluster.num_gpus, cluster=cluster, cluster_ref=cluster.name,
                             gpus_per_node=plan.cluster.gpus_per_node, global_batch=tr.global_batch_size,
                             seq_len=tr.seq_len, dtype=tr.dtype, optimizer=tr.optimizer, top_k=api.searched_top(get_engine(engine), 1),
                             knobs=knobs, micro_batches=tuple(sorted({1, 2, 4, 8, tr.micro_batch_size})))
        found = api.engine_plans(found, get_engine(engine), 1)
        best, best_est = found.plans[0], found.result.top[0].estimate
        gain = recipe.step_time_s / best_est.step_time_s - 1
        if best_est.step_time_s > recipe.step_time_s * (1 + 1e-6):
            slower.append(name)
        rows.append([group, name, str(plan.cluster.num_gpus), plan_brief(plan), f"{recipe.step_time_s:.3f}",
                     "yes" if recipe.fits else "NO", plan_brief(best), f"{best_est.step_time_s:.3f}", f"{gain * 100:+.1f}",
                     f"{time.perf_counter() - t0:.1f}"])
        if gain > MUCH_FASTER:
            notes.append(f"{name}: {where_time_goes(recipe.time_breakdown_s, best_est.time_breakdown_s)}")
        print(f"  {name}: done", file=sys.stderr, flush=True)
    print(table(["source", "recipe", "GPUs", "recipe plan", "recipe s", "fits", "best plan", "best s",
                 "best faster %", "search s"], rows))
    if notes:
        print(f"\nwhere the time goes (best plans more than {MUCH_FASTER:.0%} faster; terms of the step, recipe -> best):")
        for line in notes:
            print(f"  {line}")
    gains = [float(r[8]) for r in rows]
    print(f"\n{len(rows)} recipes: the best plan is {min(gains):+.1f} to {max(gains):+.1f} % faster "
          f"(median {sorted(gains)[len(gains) // 2]:+.1f} %); {len(slower)} predicted slower than the recipe "
          f"{'(' + ', '.join(slower) + ')' if slower else ''} [{time.perf_counter() - start:.0f} s]")
    return 1 if slower else 0


if __name__ == "__main__":
    raise SystemExit(main())
