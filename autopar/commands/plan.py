"""``autopar plan``: search the fastest plan that fits memory and write it as plan YAML v1.

``--gpus``, ``--global-batch`` and ``--seq-len`` take lists: more than one point is a sweep (one
table, one plan file per point). ``--tp``, ``--pp`` ... narrow the space; plans record them under
``prediction.search.fixed_by_user``. A warm run (graph cache hit) never imports torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from autopar.cluster import usable_text
from autopar.commands.args import check_moe_imbalance, gpu_counts, int_list, positive_int, warn
from autopar.engines.capability import ENGINE_NAMES
from autopar.errors import AutoparError
from autopar.plan import CP_KINDS, DTYPES, OFFLOAD_LABELS, OPTIMIZERS
from autopar.search.space import SEARCH_RECOMPUTE_MODES

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def choice_list(choices: tuple[str, ...], aliases: dict[str, str] | None = None) -> Any:
    """argparse type: a comma list of ``choices``."""
    def parse(text: str) -> tuple[str, ...]:
        values = tuple((aliases or {}).get(x.strip(), x.strip()) for x in text.split(",") if x.strip())
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)}, got {text!r}")
        return values
    return parse


def zero_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(v not in (0, 1, 2, 3) for v in values):
        raise argparse.ArgumentTypeError(f"expected ZeRO stages from 0,1,2,3, got {text!r}")
    return values


def on_off_list(text: str) -> tuple[bool, ...]:
    return tuple(v == "on" for v in choice_list(("on", "off"))(text))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.py", help="model file (see the model-file contract in README)")
    p.add_argument("--gpus", type=gpu_counts, required=True, metavar="N[,N...]",
                   help="number of GPUs to plan for; a list (64,128,256) sweeps and prints one table")
    p.add_argument("--gpus-per-node", type=positive_int, metavar="G", help="GPUs per node (default: the profile's)")
    p.add_argument("--cluster", metavar="NAME|PATH",
                   help="cluster profile (default a100-80g, or --profile when it is a full profile; see 'autopar profiles')")
    p.add_argument("--profile", metavar="PATH",
                   help="measured profile (autopar profile): layered over --cluster, or the cluster itself when full")
    p.add_argument("--global-batch", type=int_list, metavar="B[,B...]",
                   help="samples per optimizer step (default: the multiple of N nearest 4M tokens; 32 x N for a "
                        "model without SEQ_LEN; with a CPU profile 8 x N, seconds a step); a list sweeps")
    p.add_argument("--seq-len", type=int_list, metavar="S[,S...]",
                   help="tokens per sample (default: the model file's SEQ_LEN); a list sweeps")
    p.add_argument("--dtype", choices=DTYPES,
                   help="training dtype (default: the measured profile's, else bf16)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="optimizer (default adam)")
    p.add_argument("--engine", choices=ENGINE_NAMES, default="autopar",
                   help="plan for this engine: only what it runs (its dimensions, schedules, ZeRO stages, recompute, "
                        "offload), priced with its software profile where one exists (h100-80g -> "
                        "h100-80g-megatron); then 'autopar export PLAN.yaml --to ENGINE' (docs/engines.md)")
    p.add_argument("--top", type=positive_int, default=5, metavar="K", help="how many plans to rank (default 5)")
    p.add_argument("-o", "--output", metavar="PLAN.yaml",
                   help="where to write the best plan (default plans/<model>-<N>gpu.yaml; in a sweep: a directory)")
    p.add_argument("--no-cache", action="store_true",
                   help="trace the model file again instead of reading its graph from the cache "
                        "(~/.cache/autopar; needed after editing a module the model file imports)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="sweeps: draw tokens/s and MFU against the sweep points (needs matplotlib: autopar[plot])")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--verify", type=positive_int, metavar="K",
                   help="rehearse the top K plans (autopar rehearse: the executor at full scale on fake GPUs) before "
                        "writing one: a 'rehearsed GiB' column, and a plan whose rehearsed peak exceeds the device "
                        "memory is dropped with a line saying so (minutes for large models)")
    g = p.add_argument_group("constraints", "narrow the search (each a value or a comma list); the table stars "
                                            "and the plan records what you fixed")
    g.add_argument("--dp", type=int_list, metavar="D", help="data-parallel degrees")
    g.add_argument("--tp", type=int_list, metavar="T", help="tensor-parallel degrees")
    g.add_argument("--pp", type=int_list, metavar="P", help="pipeline-parallel degrees")
    g.add_argument("--cp", type=int_list, metavar="C", help="context-parallel degrees")
    g.add_argument("--zero", type=zero_list, metavar="Z", help="ZeRO stages (0-3)")
    g.add_argument("--recompute", type=choice_list(SEARCH_RECOMPUTE_MODES), metavar="|".join(SEARCH_RECOMPUTE_MODES),
                   help="activation recompute modes; op: per-op selective (every other matrix product's output and "
                        "attention's kept); mixed: per pipeline rank, how many blocks use each mode, "
                        "chosen by the split program, for every configuration (by default only the top plans are "
                        "solved again as mixes of the modes allowed here)")
    g.add_argument("--schedule", type=choice_list(SCHEDULES, {"interleaved": "interleaved-1f1b"}),
                   metavar="|".join(SCHEDULES), help="pipeline schedules (pipelined plans only; add --pp to exclude pp 1)")
    g.add_argument("--micro-batch", type=int_list, metavar="1,2,4,8",
                   help="micro-batch sizes (default: the search tries 1,2,4,8)")
    g.add_argument("--cp-kind", type=choice_list(CP_KINDS), metavar="|".join(CP_KINDS), help="context-parallel kinds")
    g.add_argument("--sp", type=on_off_list, metavar="on|off", help="Megatron sequence parallelism (with tp > 1)")
    g.add_argument("--virtual-stages", type=int_list, metavar="V",
                   help="virtual stages per pipeline rank (1: gpipe/1f1b; >1: interleaved; pipelined plans only)")
    g.add_argument("--ep", type=int_list, metavar="E",
                   help="expert-parallel degrees (mixture-of-experts models; ep divides the experts and dp x cp)")
    g.add_argument("--offload", type=choice_list(OFFLOAD_LABELS, {"off": "none", "all": "params+activations"}),
                   metavar="none|optimizer|params|activations|optimizer+activations|params+activations",
                   help="host-memory offload modes (default: all, used only where a plan needs it): "
                        "optimizer = Adam states on the host, step on the CPU; params = FSDP2 CPU offload of "
                        "params, grads and optimizer (zero 3); activations = saved activations on the host "
                        "(recompute none)")
    p.add_argument("--memory-margin", type=float, default=None, metavar="F",
                   help="share of each GPU's memory the plans leave free (default: the profile's "
                        "gpu.memory_margin_fraction, 0.03 on the shipped GPUs: the cost model's error against "
                        "rehearsals and the allocator's slack; 0 fills the device)")
    p.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F",
                   help="mixture of experts: the busiest expert-parallel rank's token load over the mean "
                        "(default 1.0, balanced routing; 1.2 = 20%% more), pricing ep > 1")
    from autopar.usercode import add_timeout_argument

    add_timeout_argument(p)
    o = p.add_argument_group("objective", "what the best plan minimises (docs/batch-size.md)")
    o.add_argument("--objective", choices=("throughput", "time-to-target"), default="throughput",
                   help="throughput (default): the fastest step at each global batch; time-to-target: the GPU count "
                        "and batch of the sweep that reach the target soonest, S(B) = S_min (1 + B_noise/B) steps "
                        "anchored at --target-steps at --at-batch, times the best plan's step time")
    o.add_argument("--noise-scale", type=float, metavar="B",
                   help="time-to-target: the gradient noise scale B_noise, in samples (the unit of --global-batch)")
    o.add_argument("--noise-scale-from", metavar="RUN.json",
                   help="time-to-target: read the noise scale (gradient_noise_scale.b_simple) from the report of "
                        "'autopar run --report'")
    o.add_argument("--target-steps", type=float, metavar="S0",
                   help="time-to-target: the optimizer steps to reach the target at --at-batch")
    o.add_argument("--at-batch", type=int, metavar="B0", help="time-to-target: the global batch (samples) of S0")


def constraints_of(args: argparse.Namespace) -> dict[str, tuple]:
    """The constraint flags the user gave, in flag order (keys of driver.CONSTRAINTS)."""
    names = ("dp", "tp", "pp", "cp", "zero", "recompute", "schedule", "micro_batch", "cp_kind", "sp",
             "virtual_stages", "ep", "offload")
    return {k: tuple(getattr(args, k)) for k in names if getattr(args, k, None) is not None}


def main(args: argparse.Namespace) -> int:
    from autopar.search import cp_sat_process

    with cp_sat_process.overlapped():  # OR-Tools imports on another core while the graph loads and the search runs
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    from autopar import api
    from autopar.outputs import check_output_dir, check_output_file
    from autopar.usercode import configure

    configure(timeout_s=args.timeout)
    check_moe_imbalance(args.moe_imbalance)
    # loaded once, priced for each point; an engine's software profile where one exists (plan --engine)
    cluster = api.engine_cluster_choice(args.engine, args.cluster, args.profile, warn)
    if args.memory_margin is not None:
        cluster = api.with_memory_margin(cluster, args.memory_margin)
    constraints = constraints_of(args)
    batches, seqs = args.global_batch or (None,), args.seq_len or (None,)
    from autopar.search.time_to_target import objective_of

    objective = objective_of(kind=args.objective, noise_scale=args.noise_scale, noise_scale_from=args.noise_scale_from,
                             target_steps=args.target_steps, at_batch=args.at_batch, seq_lens=seqs)
    sweep = len(args.gpus) * len(batches) * len(seqs) > 1
    if args.verify and sweep:
        raise AutoparError("--verify rehearses the plans of one point: drop the lists, or rehearse each plan with "
                           "'autopar rehearse PLAN.yaml'")
    if args.plot and not sweep:
        raise AutoparError("--plot draws a sweep: give a list (--gpus 64,128,256); for one plan use "
                           "'autopar explain PLAN.yaml --plot FILE.png'")
    plotting = None
    if args.plot:
        from autopar.explain.plot import require_matplotlib

        plotting = require_matplotlib()  # fail before searching, not after
    # Outputs are checked before the search: never search for a plan that cannot be written.
    if sweep:
        check_output_dir(args.output or "plans", "-o")
    else:
        output = Path(args.output) if args.output else Path("plans") / f"{Path(args.model).stem}-{args.gpus[0]}gpu.yaml"
        check_output_file(output, "-o")
    if args.plot:
        check_output_file(args.plot, "--plot")

    def progress(done: int, total: int, elapsed: float) -> None:
        if not args.quiet and not sweep:
            end = "\n" if done == total else ""
            print(f"\rsearching: {done}/{total} branches, {elapsed:.1f} s", end=end, file=sys.stderr, flush=True)

    def plan_point(n: int, batch: int | None, seq: int | None):  # noqa: ANN202
        return api.plan_search(args.model, n, cluster, gpus_per_node=args.gpus_per_node, global_batch=batch,
                               seq_len=seq, dtype=args.dtype, optimizer=args.optimizer, top=args.top,
                               moe_imbalance=args.moe_imbalance, constraints=constraints, progress=progress,
                               use_cache=not args.no_cache, warn=warn, engine=args.engine)

    if not sweep:
        found = plan_point(args.gpus[0], batches[0], seqs[0])
        if found.warning:
            warn(found.warning)
        from autopar.search.result import result_report

        extra, best, dropped = {}, 0, []
        if args.verify:
            extra, best, dropped = _verify(found, args)
        print(result_report(found.result, list(found.plans), found.graph, found.cluster, found.space, found.fixed,
                            extra=extra))
        for line in dropped:
            print(line)
        chosen = found.plans[best]
        if objective is not None:  # time to target of the one point
            from autopar.search import time_to_target as ttt

            model = ttt.step_model_of(objective)
            row = ttt.time_to_target_row(gpus=args.gpus[0], global_batch_samples=chosen.training.global_batch_size,
                                         step_time_s=chosen.prediction["step_time_s"], model=model,
                                         plan_label=f"#{best + 1}")
            print("\n" + ttt.time_to_target_report([row], model))
            chosen = ttt.with_objective(chosen, objective, row, best=True)
        _save(chosen, output)
        print(f"\n{'best plan' if best == 0 else f'plan #{best + 1}'} written to {output}")
        if args.engine != "autopar":
            print(f"for {args.engine}: autopar export {output} --to {args.engine}")
        return 0
    return _sweep(args, plan_point, batches, seqs, plotting, objective=objective)


def _verify(found: Any, args: argparse.Namespace) -> tuple[dict[str, list[str]], int, list[str]]:
    """Rehearse the top ``args.verify`` plans: the 'rehearsed GiB' column (peak over the rehearsed
    ranks, reserve included), the index of the best plan whose rehearsal fits, and one line per
    plan dropped. Raises InfeasibleError when none of them fits."""
    from autopar import api
    from autopar.errors import InfeasibleError

    k = min(args.verify, len(found.plans))
    column, dropped, best = ["-"] * len(found.plans), [], None
    for i, plan in enumerate(found.plans[:k]):
        def progress(text: str, i: int = i) -> None:
            if not args.quiet:
                print(f"verify plan #{i + 1}: {text}", file=sys.stderr, flush=True)

        reh = api.rehearsal(plan, args.model, found.cluster, progress=progress, use_cache=not args.no_cache, warn=warn)
        peak = max(r.peak_bytes for r in reh.ranks)
        column[i] = f"{peak / 2**30:.1f}"
        if reh.fits:
            best = i if best is None else best
        else:
            dropped.append(f"dropped plan #{i + 1}: its rehearsal peaks at {peak / 2**30:.1f} GiB, above the "
                           f"{reh.capacity_bytes / 2**30:.1f} GiB of {reh.cluster}")
    if best is None:
        raise InfeasibleError(f"none of the top {k} plans fits when rehearsed (the largest rehearsed peak is above "
                              f"the device memory); raise --verify, or plan with more GPUs")
    return {"rehearsed GiB": column}, best, dropped


def _save(plan: Any, output: Path) -> None:
    import dataclasses

    from autopar.plan import portable_model_path, save_plan

    # the plan runs from any directory (autopar.plan.model_path reads the path back)
    model = dataclasses.replace(plan.model, file=portable_model_path(plan.model.file, output))
    try:
        save_plan(dataclasses.replace(plan, model=model), output)
    except OSError as exc:
        raise AutoparError(f"cannot write {output}: {exc.strerror}") from None


def _sweep(args: argparse.Namespace, plan_point: Any, batches: tuple, seqs: tuple, plotting: Any,
           objective: Any = None) -> int:
    from autopar.search.result import constraint_text
    from autopar.search.sweep import run_sweep, sweep_points, sweep_report

    points = sweep_points(args.gpus, batches, seqs)
    if not args.quiet:
        print(f"sweep: {len(points)} points", file=sys.stderr)
    done = run_sweep(points, plan_point)
    ok = [p for p in done if p.found is not None]
    first = (ok or [None])[0]
    if first is not None:
        g, c = first.found.graph, first.found.cluster
        print(f"model    {g.name}: {g.num_blocks} blocks    cluster {c.name}: {c.gpus_per_node} GPUs per node, "
              f"{usable_text(c)} each")
        if first.found.fixed:
            print(f"fixed    {constraint_text(first.found.fixed)} (by you)")
        print()
    ttt_rows, ttt_best = None, None
    if objective is not None:  # time to target: steps x step time per point, the least marked
        from autopar.search import time_to_target as ttt

        model = ttt.step_model_of(objective)
        ttt_rows = ttt.rows_of_sweep(done, model)
        ttt_best = ttt.best_index(ttt_rows)
        print(ttt.time_to_target_report(ttt_rows, model))
    else:
        print(sweep_report(done))
    for p in done:
        if p.error:
            print(f"{p.gpus} GPUs: {p.error}", file=sys.stderr)
    if not ok:
        raise AutoparError("no point of the sweep has a plan that fits (reasons above)")
    outdir = Path(args.output) if args.output else Path("plans")
    print()
    for p in ok:
        name = f"{p.found.source.name}-{p.gpus}gpu"
        if len(batches) > 1:
            name += f"-gb{p.found.space.global_batch}"
        if len(seqs) > 1:
            name += f"-seq{p.found.space.seq_len}"
        best_plan = p.found.plans[0]
        if ttt_rows is not None:
            i = next(k for k, q in enumerate(done) if q is p)
            best_plan = ttt.with_objective(best_plan, objective, ttt_rows[i], best=i == ttt_best)
            if i == ttt_best:
                chosen_file = outdir / f"{name}.yaml"
        _save(best_plan, outdir / f"{name}.yaml")
    print(f"best plans written to {outdir}/ ({len(ok)} files)")
    if ttt_rows is not None:
        print(f"{ttt.best_line(ttt_rows[ttt_best])}: {chosen_file}")
    if plotting is not None:
        from autopar.explain.plot import plot_sweep

        if ttt_rows is not None:
            from autopar.explain.plot import plot_time_to_target

            plot_time_to_target(ttt_rows, args.plot)
            print(f"time-to-target plot written to {args.plot}")
        else:
            plot_sweep(done, args.plot)
            print(f"scaling plot written to {args.plot}")
    return 0
