"""``autopar validate PLAN.yaml [MODEL.py]``: run a plan briefly, compare with its prediction.

Launch is like ``autopar run``: outside torchrun, a plan of N > 1 ranks starts its N ranks on this
host with autopar's own launcher (autopar.launch.local: loopback only, one line for a rank that
dies or hangs, signals forwarded); ``--nproc-per-node`` may say N, and must agree with the plan. A
1-rank plan runs in-process; under your own torchrun every rank runs as started. The plan is
applied with the executor's one bring-up (executor/runtime/start.py: process group, mesh, executable,
after this command's own preflight) and train.train for ``--steps`` steps; rank 0 reports
progress on stderr, one line per step with the time left.

Prediction: re-estimated with ``--profile`` / ``--cluster`` when given, else the plan's
``prediction`` mapping (step time and the peak-rank memory; per-rank memory needs a re-estimate).
Either way the run is checked against the conditions the measured profile was taken in (dtype,
device, ranks on this host, threads per rank, torch: autopar.profile_conditions): a one-line
warning for a soft difference, an error where the comparison would be meaningless.

Measured, per rank:
* step time: the slowest rank's step time, median over the steady steps: the warm-up (the first
  step, and on until the times settle within 10 % of the late steps' median, at most half the
  steps) is left out (autopar.executor.runtime.steady). ``--steps`` defaults to about
  AUTO_STEPS_SECONDS of predicted steps, MIN_AUTO_STEPS to MAX_AUTO_STEPS;
* peak memory over the training steps (the build's peak reset away). On GPU, measured whole: the
  device use at the caching allocator's peak (``max_memory_reserved`` plus what lives outside the
  allocator -- CUDA context, cuBLAS workspaces, NCCL buffers -- from ``mem_get_info``), with
  ``max_memory_allocated`` per rank beside it, so the profile's reserve is checked, not assumed.
  On CPU, allocator-level plus the profile's framework reserve (the Python, torch and gloo
  process): the CPU has no allocator statistics, so one more (untimed) step runs after the timed
  ones under ``autopar.profiler.memory.step_allocated_bytes`` -- the bytes of every tensor alive
  before it plus the peak of what its ops allocate. It leaves out allocator slack (glibc keeps
  freed heap pages: at 4 ranks on 2 cores the peak RSS of a DP rank grew ~60 MiB between steps 1
  and 2 with no tensor more) and gloo's own buffers. The peak RSS (``ru_maxrss``) and the
  executor's RSS growth are reported beside it.
* the machine's drift (CPU runs priced from a profile with a contention curve): after training,
  every rank times the profile's reference block at once; its median against the profile's curve
  at the run's ranks is the factor the machine moved by since profiling, and the step-time error
  against the prediction times that factor is printed beside the plain one (autopar.profiler.drift).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from typing import Any

from autopar.commands.args import warn as say_warning
from autopar.errors import AutoparError
from autopar.executor.runtime.steady import steady_state
from autopar.launch.rank import under_launcher
from autopar.profiler.cores import usable_cores

# --steps by default: about this much predicted training time, within these step counts
AUTO_STEPS_SECONDS, MIN_AUTO_STEPS, MAX_AUTO_STEPS = 10.0, 8, 30
_SAID = "AUTOPAR_VALIDATE_CONDITIONS_SAID"  # the launcher already printed the condition warnings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN.yaml", help="plan file (YAML v1)")
    p.add_argument("model", metavar="MODEL.py", nargs="?", help="model file (default: the plan's model.file)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps; the step time is the median of the steady ones, after the warm-up "
                        f"(default: about {AUTO_STEPS_SECONDS:g} s of predicted steps, {MIN_AUTO_STEPS} to "
                        f"{MAX_AUTO_STEPS})")
    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="ranks to start on this host (default: the plan's world size)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="where the ranks run: cuda, cpu, or auto: cuda when present (default; also $AUTOPAR_DEVICE)")
    p.add_argument("--cluster", metavar="NAME|PATH", help="re-estimate with this cluster profile")
    p.add_argument("--profile", metavar="PATH", help="re-estimate with this measured profile")
    p.add_argument("--report", metavar="PATH", help="write the JSON comparison here (rank 0)")
    p.add_argument("--seed", type=int, default=0, help="weights and data seed (default 0)")


def _say(line: str) -> None:
    print(f"autopar validate: {line}", file=sys.stderr, flush=True)


def run_conditions(plan, device_type: str | None = None):  # noqa: ANN001, ANN201
    """The conditions this validate runs the plan under (autopar.profile_conditions.RunConditions)."""
    import torch

    from autopar.executor.parallel.mesh import chosen_device_type
    from autopar.profile_conditions import RunConditions
    from autopar.profiler.profile_file import device_name

    device_type = device_type or chosen_device_type()
    world = plan.parallel.world_size
    return RunConditions(dtype=plan.training.dtype, ranks_on_host=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                         device_type=device_type, device_name=device_name(torch.device(device_type)),
                         threads_per_rank=1 if device_type == "cpu" else None, torch_version=str(torch.__version__))


def predict(plan_path: str, model: str, cluster: str | None, profile: str | None,
            device_type: str | None = None, warn: bool = True) -> dict[str, Any]:
    """{step_time_s, peak_memory_bytes, stage_memory_bytes (None without re-estimate),
    reserve_bytes (the cluster's framework reserve, inside the predicted peak), source}. Checks the
    run's conditions against the measured profile (ClusterError on a hard mismatch; the warnings
    printed when ``warn``)."""
    from autopar import api
    from autopar.executor.runtime.run_report import read_prediction
    from autopar.plan import load_plan

    plan = load_plan(plan_path)
    choice = api.choose_cluster(cluster, profile, plan.cluster.profile)
    run = run_conditions(plan, device_type)
    c = api.price(choice, run, model_label=model, warn=say_warning if warn else _ignore)
    reference = _drift_reference(choice.cluster, run)
    if cluster is None and profile is None:
        pred = read_prediction(plan_path)
        if "step_time_s" not in pred:
            raise AutoparError(f"{plan_path} has no prediction; give --cluster or --profile to estimate it")
        return {"step_time_s": float(pred["step_time_s"]), "peak_memory_bytes": float(pred.get("peak_memory_bytes", 0)),
                "stage_memory_bytes": None, "reserve_bytes": c.framework_reserve_bytes, "source": "plan prediction",
                "reference": reference}
    from autopar.cost.estimate import estimate_plan
    from autopar.graph import build_graph
    from autopar.modelfile import load_model_file

    graph = build_graph(load_model_file(model), seq_len=plan.training.seq_len, dtype=plan.training.dtype)
    est = estimate_plan(plan, graph, c)
    return {"step_time_s": est.step_time_s, "peak_memory_bytes": est.peak_memory_bytes,
            "reserve_bytes": c.framework_reserve_bytes,
            "stage_memory_bytes": [r.peak_bytes for r in est.ranks], "source": f"estimate ({profile or cluster})",
            "reference": reference}


def _ignore(message: str) -> None:
    """A rank other than 0, or a rank whose launcher already printed the warnings: say nothing."""


def _drift_reference(cluster, run) -> dict[str, Any] | None:  # noqa: ANN001
    """The profile's contention reference at the run's ranks on this host (autopar.profiler.drift),
    or None (not a CPU run, or no curve in the profile)."""
    from autopar.profiler.drift import profiled_reference

    return profiled_reference(cluster, run.ranks_on_host) if run.device_type == "cpu" else None


def auto_steps(predicted_step_s: float) -> int:
    """The default ``--steps``: about AUTO_STEPS_SECONDS of predicted training, so that a short step
    gets enough steps past its warm-up for a steady median, and a long one no more than it needs."""
    if predicted_step_s <= 0:
        return MAX_AUTO_STEPS
    return max(MIN_AUTO_STEPS, min(MAX_AUTO_STEPS, math.ceil(AUTO_STEPS_SECONDS / predicted_step_s)))


def _launch(args: argparse.Namespace, model: str, nproc: int, prediction: dict[str, Any]) -> int:
    """Start the plan's ``nproc`` ranks on this host (launch/local.py) and wait for them."""
    from autopar.launch.local import LocalJob, run_local

    cmd = ["-m", "autopar", "validate", args.plan, model, "--steps", str(args.steps), "--seed", str(args.seed)]
    for flag in ("cluster", "profile", "report"):
        if getattr(args, flag):
            cmd += [f"--{flag}", str(getattr(args, flag))]
    guess = prediction["step_time_s"] * (args.steps + 1)  # + the untimed memory step on CPU
    _say(f"starting {nproc} ranks on this host; predicted {prediction['step_time_s']:.3g} s a step, "
         f"~{max(guess, 1.0):.0f} s for {args.steps} steps after start-up")
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), _SAID: "1"}
    return run_local(LocalJob(argv=tuple(cmd), nproc=nproc, env=env))


def main(args: argparse.Namespace) -> int:
    from autopar.executor.runtime.checks import check_world_size, preflight
    from autopar.launch.environment import check_environment
    from autopar.modelfile import load_model_file
    from autopar.plan import load_plan, model_path

    if args.steps is not None and args.steps < 2:
        raise AutoparError(f"--steps must be >= 2 (the first step is warm-up), got {args.steps}")
    check_environment(args.nproc_per_node)  # before any rank starts: a stale or partial torchrun environment
    plan = load_plan(args.plan)
    model = args.model or model_path(plan.model.file, args.plan)
    mf = load_model_file(model)
    if not under_launcher():
        from autopar.commands.run import set_device_choice

        nproc = args.nproc_per_node or plan.parallel.world_size
        set_device_choice(args.device, nproc)
        check_world_size(plan, nproc)
        if nproc > 1:
            preflight(plan, mf, nproc)
            prediction = predict(args.plan, model, args.cluster, args.profile)  # fail early, before starting ranks
            args.steps = args.steps or auto_steps(prediction["step_time_s"])
            return _launch(args, model, nproc, prediction)
    else:
        from autopar.launch.rank import arm_parent_death_signal

        arm_parent_death_signal()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_world_size(plan, world)
    spec, _ = preflight(plan, mf, world)
    rank0 = os.environ.get("RANK", "0") == "0"
    prediction = predict(args.plan, model, args.cluster, args.profile, warn=rank0 and not os.environ.get(_SAID))
    args.steps = args.steps or auto_steps(prediction["step_time_s"])  # the launcher passes its own on
    return _run(args, plan, mf, spec, world, prediction)


def _run(args: argparse.Namespace, plan, mf, spec, world: int, prediction: dict[str, Any]) -> int:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from autopar.executor.parallel.mesh import device_for_rank
    from autopar.executor.runtime.start import Join, StartOptions, start
    from autopar.executor.runtime.train import train

    t0 = time.monotonic()
    device = device_for_rank()
    if device.type == "cpu":
        torch.set_num_threads(1)
    before: dict[str, Any] = {}

    def joined() -> None:  # the process's memory and the machine's load before the plan is applied
        before["baseline"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        before["load"] = _load_average()

    try:
        exe = start(plan, mf, StartOptions(seed=args.seed, lr=1e-3, device=device, spec=spec,
                                           join=Join(timeout_s=600), after_join=joined))
        rank = dist.get_rank()
        log = (lambda s: _say(s)) if rank == 0 else None
        baseline, load_before = before["baseline"], before["load"]
        if log:
            log(f"plan applied on {world} rank(s) in {time.monotonic() - t0:.1f} s; training {args.steps} steps")
        result = train(exe, mf, steps=args.steps, seed=args.seed, log=log)
        load_after = _load_average()
        drift = _machine_drift(mf, plan, prediction.get("reference"), device, log)
        if device.type == "cuda":
            from autopar.executor.runtime.train import cuda_device_peak_bytes

            allocated, device_peak = map(float, cuda_device_peak_bytes(device))
            peak = device_peak  # measured whole: the reserve is read, not assumed
        else:
            if log:
                log("measuring one more step's memory")
            allocated = float(sum(_cpu_step_allocated(exe, mf, args.steps, args.seed)))
            peak = allocated + prediction["reserve_bytes"]
        rss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        mine = torch.tensor([peak, float(baseline), rss, allocated], dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        if rank == 0:
            report = build_report(plan, result, [g.tolist() for g in gathered], prediction, device.type, args)
            report["machine_load"] = machine_load(load_before, load_after, dist.get_world_size(), device.type)
            report["machine_drift"] = drift_report(drift, report["step_time_s"])
            print(format_report(report), flush=True)
            if args.report:
                from autopar.plan import write_text_atomic

                write_text_atomic(args.report, json.dumps(report, indent=2) + "\n")
        dist.barrier()
    finally:
        if dist.is_initialized():  # a failed join leaves no group to destroy
            dist.destroy_process_group()
    return 0


def _machine_drift(mf, plan, reference: dict[str, Any] | None, device, log):  # noqa: ANN001, ANN202
    """The MachineDrift of this run (every rank times the profile's reference at once), or None."""
    import torch
    import torch.distributed as dist

    from autopar.profiler.drift import MachineDrift, time_reference_now

    if reference is None or device.type != "cpu" or reference["model_sha256"] != mf.sha256:
        return None  # not a CPU run, or the profile's curve is another model's block
    if log:
        log("timing the profile's reference block on every rank (the machine's speed now)")
    dist.barrier()  # all ranks at once: the run's own concurrency
    mine = torch.tensor([time_reference_now(mf, reference["micro_batch"], plan.training.dtype, reference["ranks"])],
                        dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return MachineDrift(ranks=reference["ranks"], profiled_s=reference["profiled_s"],
                        now_s=statistics.median(float(t) for t in every))


def drift_report(drift, step: dict[str, Any]) -> dict[str, Any] | None:  # noqa: ANN001
    """The report's ``machine_drift``: the reference then and now, and the step-time error against
    the prediction times the drift factor (autopar.profiler.drift)."""
    if drift is None:
        return None
    return {"ranks": drift.ranks, "reference_profiled_s": drift.profiled_s, "reference_now_s": drift.now_s,
            "factor": drift.factor, "error_after_drift_pct": _err(step["measured"], step["predicted"] * drift.factor)}


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # not on every platform
        return None


def machine_load(before: float | None, after: float | None, world: int, device_type: str) -> dict[str, Any]:
    """Whether other work shared the cores while this run measured: the 1-minute load average
    (before and after training) against the cores, less this run's own ranks (one busy core each
    on CPU). ``loaded`` is true when the rest exceeds a quarter of the cores (at least one)."""
    cores = usable_cores()
    own = world if device_type == "cpu" else 0
    seen = max((v for v in (before, after) if v is not None), default=None)
    other = None if seen is None else max(0.0, seen - own)
    loaded = other is not None and other > max(1.0, cores / 4)
    return {"load_average_1m": [before, after], "cores": cores, "own_ranks": own, "other_load": other,
            "loaded": loaded}


def live_tensors() -> list:
    """Every tensor the garbage collector tracks. The test is on the object's type: ``isinstance``
    reads ``__class__``, which on torch.distributed's deprecated ``reduce_op`` prints a FutureWarning
    into validate's output."""
    import gc

    import torch

    gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def _cpu_step_allocated(exe, mf, step: int, seed: int) -> tuple[int, int]:  # noqa: ANN001
    """(bytes alive before, peak allocated during) one more training step of this rank.

    Alive before: every tensor storage Python can reach -- parameters, gradients, optimizer states,
    and what the engines keep between steps out of the module tree's sight: FSDP2's unsharded
    parameters under ZeRO-1 (kept across steps), torch pipelining's receive buffers."""
    from autopar.executor.runtime.train import _Trainer, rank_batch
    from autopar.profiler.memory import step_allocated_bytes

    before = live_tensors()
    # DDP's gradient buckets live in C++, out of Python's sight: one flat copy of the gradients
    buckets = sum(p.numel() * p.element_size() for w in exe.dp if w.kind == "ddp"
                  for p in w.module.parameters() if p.requires_grad)
    batch = rank_batch(exe, mf, step, seed)
    trainer = _Trainer(exe, mf)
    alive, peak = step_allocated_bytes(before, lambda: trainer.step(batch))
    return alive + buckets, peak


def _err(measured: float, predicted: float | None) -> float | None:
    return None if not predicted else 100.0 * (measured - predicted) / predicted


def build_report(plan, result, per_rank: list[list[float]], prediction: dict[str, Any], device_type: str,  # noqa: ANN001
                 args: argparse.Namespace) -> dict[str, Any]:
    par = plan.parallel
    steady = steady_state(result.step_times_s)
    step = steady.step_time_s
    stage_mem = prediction.get("stage_memory_bytes")
    ranks = []
    for r, (peak, baseline, rss, *rest) in enumerate(per_rank):
        pp_rank = r // (par.tp * par.cp * par.dp)
        pred_mem = stage_mem[pp_rank] if stage_mem else None
        ranks.append({"rank": r, "pp_rank": pp_rank, "measured_peak_bytes": peak, "baseline_bytes": baseline,
                      "peak_rss_bytes": rss, "allocated_peak_bytes": rest[0] if rest else None,
                      "executor_growth_bytes": result.peak_memory_bytes[r], "predicted_peak_bytes": pred_mem,
                      "memory_error_pct": _err(peak, pred_mem)})
    peak = max(r["measured_peak_bytes"] for r in ranks)
    return {
        "plan": str(args.plan), "world_size": len(per_rank), "steps": args.steps,
        "parallel": {k: getattr(par, k) for k in ("dp", "tp", "pp", "cp", "cp_kind", "zero", "recompute", "pp_schedule")},
        "micro_batch_size": plan.training.micro_batch_size,
        "prediction_source": prediction["source"],
        "step_time_s": {"measured": step, "predicted": prediction["step_time_s"],
                        "error_pct": _err(step, prediction["step_time_s"]), "all_steps_s": list(result.step_times_s),
                        "warmup_steps": steady.warmup_steps, "timed_steps": steady.timed_steps,
                        "rule": steady.describe(), "settling": steady.settling},
        "peak_memory_bytes": {"measured": peak, "predicted": prediction["peak_memory_bytes"],
                              "error_pct": _err(peak, prediction["peak_memory_bytes"])},
        "memory_measure": ("allocated tensor bytes of one step (LiveBytes) + reserve" if device_type == "cpu"
                           else "device use at the allocator's peak over the steps: max_memory_reserved + what "
                                "lives outside the allocator (CUDA context, NCCL buffers; mem_get_info)"),
        "reserve_bytes": prediction["reserve_bytes"],
        "ranks": ranks,
        "notes": list(result.notes),
    }


def format_report(rep: dict[str, Any]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.1f}%"

    st, mem = rep["step_time_s"], rep["peak_memory_bytes"]
    mib = 2**20
    lines = [f"validate {rep['plan']} ({rep['world_size']} ranks, {rep['steps']} steps; prediction: {rep['prediction_source']})",
             f"  step time    measured {st['measured']:.4f} s   predicted {st['predicted']:.4f} s   error {pct(st['error_pct'])}"
             f"   ({st.get('rule', 'median of steps after the first')})",
             f"  peak memory  measured {mem['measured'] / mib:,.1f} MiB   predicted {mem['predicted'] / mib:,.1f} MiB   "
             f"error {pct(mem['error_pct'])}   ({rep['memory_measure']}, max over ranks)",
             f"  (reserve {rep['reserve_bytes'] / mib:,.1f} MiB on both sides: the profile's framework reserve)",
             "  rank  pp  measured MiB  predicted MiB   error  peak RSS MiB  RSS before model MiB"]
    for r in rep["ranks"]:
        pred = "-" if r["predicted_peak_bytes"] is None else f"{r['predicted_peak_bytes'] / mib:,.1f}"
        lines.append(f"  {r['rank']:4d}  {r['pp_rank']:2d}  {r['measured_peak_bytes'] / mib:12,.1f}  {pred:>13s}  "
                     f"{pct(r['memory_error_pct']):>6s}  {r['peak_rss_bytes'] / mib:12,.1f}  {r['baseline_bytes'] / mib:20,.1f}")
    for n in rep["notes"]:
        lines.append(f"  note: {n}")
    if st.get("settling"):
        lines.append(f"  note: the step times were still falling over the timed steps; the steady figure is lower: "
                     f"validate with more --steps (ran {rep['steps']})")
    drift = rep.get("machine_drift")
    if drift:
        lines.append(f"  machine now  reference block {drift['reference_now_s'] * 1e3:.2f} ms on {drift['ranks']} rank(s) "
                     f"against {drift['reference_profiled_s'] * 1e3:.2f} ms in the profile ({(drift['factor'] - 1) * 100:+.0f} %): "
                     f"step-time error {pct(drift['error_after_drift_pct'])} against the prediction at today's speed")
    load = rep.get("machine_load")
    if load and load["loaded"]:
        lines.append(f"  note: the machine was loaded while measuring: load average {load['other_load']:.1f} beyond "
                     f"this run's {load['own_ranks']} rank(s) on {load['cores']} cores; measured times read high "
                     "-- validate again on an idle machine")
    elif load and load["other_load"] is not None:
        lines.append(f"  machine load while measuring: {load['other_load']:.1f} beyond this run on {load['cores']} cores "
                     "(idle enough)")
    return "\n".join(lines)
