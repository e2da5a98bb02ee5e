"""Cost-model accuracy against published measurements (../shared/calibration). Prints every public table,
each with published, predicted and error, and the mean and max |error| per table:

1. Megatron-LM SC21 Table 1: iteration time of GPT 1.7B-1T on 32-3,072 A100-80GB (targets: mean <= 3 %,
   every row <= 6 %), each row's exact configuration estimated with ``--cluster a100-80g-megatron`` and the
   software the runs used: Megatron-LM of early 2021, a synchronous TP backward (reference.sc21_cluster);
2. Korthikanti et al. 2022 Table 4: forward/backward time of one 22B layer (target: 10 %); its Table 5:
   end-to-end iteration time of the 22B-1T models (Table 3's configurations) with full recompute and
   with sequence parallelism + selective recompute, each model from a model file that declares no
   tp_plan (autopar/models/plain_gpt.py); a held-out source only, never fitted (its target -- mean <= 5 %,
   max <= 10 % -- is checked by --holdout; here informational);
3. Korthikanti et al. 2022 Table 2: activation bytes per layer, measured on meta, vs the formulas (target: 2 %);
4. ZeRO SC20 Table 1: model-state GB per device (target: 1 %, or the rounding of the printed figure);
5. h100_public.yaml, one table per group: NVIDIA dgxc recipes and Megatron-Core's weak-scaling table on
   ``h100-80g-megatron`` (targets: mean <= 5 %, max <= 10 % over both groups together), llm-foundry's
   FSDP runs on ``h100-80g`` (target: mean <= 10 %), torchtitan's run on a slower 500 W H100 variant
   (informational: that hardware is not h100-80g). One profile per GPU and software; no per-row terms;
6. torchtitan_a100.yaml: torchtitan's FSDP2 runs of Llama 2 13B / 70B and Llama 3 8B / 70B on 64 A100-80GB
   (docs/performance.md), tokens/s per GPU on ``a100-80g`` with the runs' FSDP2 settings; a held-out source
   only, never fitted (informational here; its held-out figure is printed by --holdout);
7. megatron_moe_h100.yaml: Megatron-Core MoE runs on DGX H100 (Megatron-MoE-ModelZoo: Qwen3-235B-A22B,
   Mixtral 8x22B), each the closest plan autopar expresses on ``h100-80g-megatron`` (autopar.reference_moe);
   a held-out source only, never fitted (informational: all-to-all and DeepEP rows in separate tables);
8. ranking: Kendall's tau of the predicted order of each multi-configuration source's configurations
   against the published order (autopar.reference_rank; target: tau >= 0.8 with three or more).

Usage: python benchmarks/calibration.py        (exit code 1 if any target is missed; runs in about a minute)
       python benchmarks/calibration.py --holdout   (leave-one-source-out: each H100 and A100 source predicted
                                                     with its GPU's fitted constants re-derived without it,
                                                     autopar.reference_fit; targets: held-out mean <= 5 %,
                                                     max <= 10 % per source)
       python benchmarks/calibration.py --table5-settings   (Korthikanti Table 5 interleaved as SC21 ran
                                                     the same shapes and with gradient-accumulation fusion:
                                                     settings the paper does not state; informational)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.cluster import load_cluster
from autopar.cost.estimate import estimate_plan
from autopar.cost.memory import state_bytes_per_param
from autopar.cost.stage import Config, build_terms
from autopar.models.gpt import GPTConfig
from autopar.reference import (
    KORTHIKANTI_22B,
    TABLE4_MODES,
    TABLE5_MODES,
    gpt_graph,
    load_calibration,
    megatron_plan,
    megatron_rows,
    sc21_cluster,
    table5_graph,
    table5_plan,
    table5_rows,
)
from autopar.reference_h100 import public_plan, public_runs, run_graph, software_cluster
from autopar.report import table

FAILURES: list[str] = []


def pct(predicted: float, published: float) -> float:
    return (predicted / published - 1.0) * 100.0


def check(ok: bool, what: str) -> str:
    if not ok:
        FAILURES.append(what)
    return "" if ok else "  <-- MISS"


def summary(errors: list[float], what: str, mean_target: float | None, max_target: float | None) -> str:
    """The mean and max |error| line of a table, checked against its targets (None: informational)."""
    mean, worst = sum(map(abs, errors)) / len(errors), max(map(abs, errors))
    targets = [f"{mean_target:g} % mean"] if mean_target is not None else []
    targets += [f"{max_target:g} % max"] if max_target is not None else []
    flags = check(mean_target is None or mean <= mean_target, f"{what} mean {mean:.1f} %") + check(
        max_target is None or worst <= max_target, f"{what} max {worst:.1f} %")
    return (f"mean |error| {mean:.1f} %   max |error| {worst:.1f} %   "
            f"(targets: {', '.join(targets) or 'none, informational'})" + flags)


def config(**kw: object) -> Config:
    base: dict = dict(dp=1, tp=1, pp=1, cp=1, cp_kind="ring", sequence_parallel=False, zero=0, recompute="none",
                      schedule="1f1b", virtual_stages=1, micro_batch=1, global_batch=1, seq_len=2048, dtype_bytes=2,
                      optimizer="adam")
    base.update(kw)
    base["global_batch"] = base["micro_batch"]
    return Config(**base)


def megatron_table(cluster) -> None:  # noqa: ANN001
    rows, errors = [], []
    for row in megatron_rows():
        est = estimate_plan(megatron_plan(row), gpt_graph(row.config, "fp16"), cluster)
        err = pct(est.step_time_s, row.iteration_time_s)
        errors.append(abs(err))
        layout = f"{row.tp}/{row.pp}/{row.dp}" + (f" v={row.virtual_stages}" if row.virtual_stages > 1 else "")
        rows.append((f"{row.params_billion:g}B", row.num_gpus, layout, row.micro_batch, row.global_batch,
                     f"{row.iteration_time_s:.2f}", f"{est.step_time_s:.2f}", f"{err:+.1f}", f"{est.mfu * 100:.1f}"))
    print("Megatron-LM SC21 Table 1 (A100-80GB, full recompute, fp16, a100-80g-megatron with SC21's synchronous TP backward) "
          "-- iteration time")
    print(table(["model", "GPUs", "tp/pp/dp", "mb", "batch", "published s", "predicted s", "error %", "MFU %"], rows))
    print(summary(errors, "SC21", 3, 6))
    print()


def table4(cluster) -> None:  # noqa: ANN001
    graph = gpt_graph(KORTHIKANTI_22B, "fp16")
    data = load_calibration("korthikanti_2022.yaml")["table4_one_layer_of_22B_model_ms"]
    rows, errors = [], []
    for name, fwd, bwd, total in data["rows"]:
        sp, recompute = TABLE4_MODES[name]
        block = build_terms(graph, cluster, config(tp=8, sequence_parallel=sp, recompute=recompute,
                                                   micro_batch=4)).block
        f, b = block.fwd_s * 1e3, block.bwd_s * 1e3
        ef, eb = pct(f, fwd), pct(b, bwd)
        errors += [ef, eb]
        rows.append((name, f"{fwd:.1f}", f"{f:.2f}", f"{ef:+.1f}" + check(abs(ef) <= 10, f"Table 4 {name} fwd"),
                     f"{bwd:.1f}", f"{b:.2f}", f"{eb:+.1f}" + check(abs(eb) <= 10, f"Table 4 {name} bwd"),
                     f"{total:.1f}", f"{f + b:.2f}"))
    print("Korthikanti 2022 Table 4 -- one layer of the 22B model (h 6144, a 64, s 2048, b 4, t 8), ms")
    print(table(["mode", "pub fwd", "pred fwd", "err %", "pub bwd", "pred bwd", "err %", "pub total", "pred total"],
                rows, align="lrrrrrrrr"))
    print(summary(errors, "Table 4", None, 10))
    print()


def table5(cluster) -> None:  # noqa: ANN001
    """Korthikanti 2022 Table 5 with the shipped constants, and where each predicted step goes."""
    rows, errors = [], []
    for row in table5_rows():
        graph = table5_graph(row)
        for mode in TABLE5_MODES:
            est = estimate_plan(table5_plan(row, mode), graph, cluster)
            published = row.time_s(mode)
            err = pct(est.step_time_s, published)
            errors.append(err)
            t = est.time_breakdown_s
            rows.append((row.model, mode.replace("_", " "), f"{row.tp}/{row.pp}/1", row.micro_batch, row.global_batch,
                         f"{published:.2f}", f"{est.step_time_s:.2f}", f"{err:+.1f}", f"{est.mfu * 100:.1f}",
                         f"{t['compute']:.2f}", f"{t['recompute']:.2f}", f"{t['tp_comm']:.2f}", f"{t['pp_comm']:.2f}",
                         f"{t['bubble']:.2f}", f"{t['optimizer'] + t['dp_tail']:.2f}"))
    print("Korthikanti 2022 Table 5 -- iteration time (A100-80GB, fp16, dp 1, 1F1B; model file without a tp_plan; "
          "a100-80g-megatron); where the predicted step goes, s")
    print(table(["model", "setting", "tp/pp/dp", "mb", "batch", "published s", "predicted s", "error %", "MFU %",
                 "compute", "recompute", "tp comm", "p2p", "bubble", "optimizer"], rows, align="llrrrrrrrrrrrrr"))
    print(summary(errors, "Table 5", None, None) + "  (held out, never fitted: targets 5 % mean, 10 % max "
          "checked by --holdout)")
    print()


TABLE2_SHAPES = [(2048, 1, 12288, 96, 8), (2048, 4, 6144, 64, 8), (4096, 2, 4096, 32, 4), (1024, 8, 2048, 16, 2)]
TABLE2_MODES = {  # formula -> (sequence_parallel, recompute, uses tp)
    "no_parallelism": (False, "none", False),
    "tensor_parallel": (False, "none", True),
    "tensor_and_sequence_parallel": (True, "none", True),
    "tensor_parallel_selective_recompute": (False, "selective", True),
    "tensor_sequence_selective_recompute": (True, "selective", True),
    "full_recompute": (False, "full", True),
}


def table2(cluster) -> None:  # noqa: ANN001
    formulas = load_calibration("korthikanti_2022.yaml")["activation_bytes_per_layer"]
    rows, errors = [], []
    for s, b, h, a, t in TABLE2_SHAPES:
        graph = gpt_graph(GPTConfig(num_layers=2, hidden_size=h, num_heads=a, seq_len=s, vocab_size=51200), "fp16")
        for mode, (sp, recompute, uses_tp) in TABLE2_MODES.items():
            tp = t if uses_tp else 1
            act = build_terms(graph, cluster, config(tp=tp, sequence_parallel=sp and tp > 1, recompute=recompute,
                                                     micro_batch=b, seq_len=s)).block.act_bytes
            expected = eval(formulas[mode].split("#")[0], {"__builtins__": {}},  # noqa: S307 - shared data file
                            {"s": s, "b": b, "h": h, "a": a, "t": tp})
            err = pct(act, expected)
            errors.append(err)
            rows.append((f"s{s} b{b} h{h} a{a} t{t}", mode, f"{expected / 2**20:,.1f}", f"{act / 2**20:,.1f}",
                         f"{err:+.2f}" + check(abs(err) <= 2, f"Table 2 {mode} s{s} h{h}")))
    print("Korthikanti 2022 Table 2 -- activation MiB per layer per micro-batch (formula vs measured on meta)")
    print(table(["shape", "formula", "published", "autopar", "err %"], rows, align="llrrr"))
    print(summary(errors, "Table 2", None, 2))
    print()


def _gb(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def zero_table() -> None:
    data = load_calibration("zero_sc20_table1.yaml")
    psi = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}
    rows, errors = [], []
    worst = 0.0
    for row in data["rows"]:
        nd, cells = row[0], []
        for col, published in zip(data["columns"][1:], row[1:]):
            model, z = col.split()
            gb = state_bytes_per_param(zero=stage[z], shard_degree=nd, dtype_bytes=2, optimizer="adam").total \
                * psi[model] / 1e9
            text = repr(float(published)).rstrip("0").rstrip(".")
            decimals = len(text.split(".")[1]) if "." in text else 0
            tol = max(0.01 * published, 0.5 * 10.0**-decimals)  # the paper prints rounded figures
            worst = max(worst, abs(gb - published) / published)
            errors.append(abs(gb - published) / published * 100)
            cells.append(f"{published:g} / {_gb(gb)}" + check(abs(gb - published) <= tol, f"ZeRO {col} Nd={nd}"))
        rows.append((nd, *cells))
    print("ZeRO SC20 Table 1 -- model-state GB per device, published/predicted (mixed-precision Adam)")
    print(table(["Nd", *data["columns"][1:]], rows))
    print(f"mean |error| {sum(errors) / len(errors):.2f} %   max |error| {worst * 100:.2f} %   "
          "(rounded figures in the paper, e.g. 0.12 for 0.117)")
    print()


H100_TABLES = (  # group -> title
    ("dgxc", "NVIDIA dgxc-benchmarking recipes (DGX H100, NeMo / Megatron-Core)"),
    ("megatron_core_r08", "Megatron-Core r0.8 weak scaling (H100, seq 4096; mb 1, no recompute, 1F1B assumed)"),
    ("llm_foundry", "llm-foundry FSDP FULL_SHARD (H100-80GB, MPT)"),
    ("torchtitan", "torchtitan FSDP2 (Grand Teton: 500 W H100 96 GB -- not h100-80g hardware)"),
    ("dgxc_llama31", "NVIDIA dgxc-benchmarking Llama 3.1 8B / 70B / 405B (DGX H100, NeMo, context parallelism 2)"),
)


def h100_tables() -> None:
    """Every group of h100_public.yaml: step time published vs predicted on the profile of its software."""
    errors: dict[str, list[float]] = {}
    for group, title in H100_TABLES:
        rows = []
        for run in public_runs(group):
            cluster, profile = software_cluster(run)
            est = estimate_plan(public_plan(run, profile), run_graph(run), cluster)
            err = pct(est.step_time_s, run.step_time_s)
            errors.setdefault(group, []).append(err)
            setting = f"zero {run.zero}" + (" sp" if run.sequence_parallel else "") + f" rc {run.recompute}"
            rows.append((run.name, run.num_gpus, run.layout, run.micro_batch, run.global_batch, setting, profile,
                         f"{run.step_time_s:.3f}", f"{est.step_time_s:.3f}", f"{err:+.1f}",
                         f"{est.peak_memory_bytes / 2**30:.1f}"))
        print(f"h100_public.yaml {group}: {title} -- step time")
        print(table(["run", "GPUs", "tp/pp/dp", "mb", "batch", "setting", "profile", "published s", "predicted s",
                     "error %", "mem GiB"], rows))
        targets = {"dgxc": (5, 10), "megatron_core_r08": (5, 10), "llm_foundry": (10, None),
                   "dgxc_llama31": (5, 10)}.get(group, (None, None))
        print(summary(errors[group], group, *targets))
        print()
    megatron = errors["dgxc"] + errors["megatron_core_r08"]
    print("dgxc + Megatron-Core H100 rows together: " + summary(megatron, "dgxc+Megatron-Core", 5, 10))
    print()


def torchtitan_a100_table() -> None:
    """torchtitan_a100.yaml: published tokens/s per GPU (torchtitan's WPS) and MFU against the
    prediction with the shipped a100-80g constants (autopar.reference_a100); the error is the step
    time's, as every other table's."""
    from autopar.reference_a100 import a100_cluster, a100_rows, tokens_per_s_per_gpu, torchtitan_mfu_pct

    rows, errors = [], []
    for row in a100_rows():
        run = row.run
        cluster, profile = a100_cluster(run)
        est = estimate_plan(public_plan(run, profile), run_graph(run), cluster)
        err = pct(est.step_time_s, run.step_time_s)
        errors.append(err)
        wps = tokens_per_s_per_gpu(run, est.step_time_s)
        mode = run.recompute if run.recompute_blocks is None else "full {2} / none {0}".format(*run.recompute_blocks[0])
        rows.append((run.name, row.ac, run.micro_batch, run.global_batch, mode, f"{row.tokens_per_s_per_gpu:,.0f}",
                     f"{wps:,.0f}", f"{err:+.1f}", f"{row.mfu_pct:.1f}", f"{torchtitan_mfu_pct(run, wps):.1f}",
                     f"{est.peak_memory_bytes / 2**30:.1f}" + ("" if est.fits else " (over)")))
    print("torchtitan_a100.yaml: torchtitan FSDP2 (zero 3, dp 64) on 64 A100-80GB, eager, bf16 / fp32 reduce "
          "(a100-80g) -- tokens/s per GPU")
    print(table(["run", "AC (source)", "mb", "batch", "recompute (blocks)", "published tok/s", "predicted tok/s",
                 "error % (step)", "MFU % pub", "MFU % pred", "mem GiB"], rows, align="llrrlrrrrrr"))
    print(summary(errors, "torchtitan A100", None, None) + "  (held out, never fitted: its held-out figure is "
          "printed by --holdout)")
    print("(MFU: torchtitan's 6 N + 12 L h s per token, N with the embedding, as its April 2024 train.py; mem: "
          "predicted peak against a100-80g's 79.15 GiB)")
    print()


def megatron_moe_table() -> None:
    """megatron_moe_h100.yaml (autopar.reference_moe): Megatron-Core MoE step times on DGX H100 against the
    closest plan autopar expresses, priced on h100-80g-megatron with the shipped constants; held out,
    never fitted. All-to-all rows (what autopar prices) and DeepEP rows in separate tables; every
    difference between the source's settings and the plan is listed under its table; a what-if column
    prices the same row with tp folded into dp (experts neither replicated over tp nor strided by it)."""
    import dataclasses

    from autopar.reference_moe import moe_rows, predict

    def layout(tp: int, pp: int, dp: int, v: int, ep: int) -> str:
        return f"{tp}/{pp}/{dp}" + (f" v{v}" if v > 1 else "") + f" ep{ep}"

    for dispatcher, title in (("a2a", "all-to-all dispatcher (what autopar prices)"),
                              ("deepep", "DeepEP dispatcher (fused, node-deduplicated all-to-all: not what autopar "
                                         "prices; reported apart)")):
        rows, errors, notes, skipped = [], [], [], []
        for row in moe_rows():
            if row.dispatcher != dispatcher:
                continue
            p = predict(row)
            if p.estimate is None:
                skipped.append(f"  {row.name}: skipped -- {p.mapped.skip}")
                continue
            est, par = p.estimate, p.mapped.plan.parallel
            errors.append(p.error_pct)
            t = est.time_breakdown_s
            twin = ""
            if row.tp > 1:
                alt = predict(dataclasses.replace(row, tp=1, dp=row.dp * row.tp))
                twin = f"{alt.estimate.step_time_s:.2f} ({alt.error_pct:+.0f} %)"
            rc = "" if row.recompute == par.recompute else f"{row.recompute or 'none'} -> "
            rows.append((row.name, row.gpus, layout(row.tp, row.pp, row.dp, row.vpp, row.ep),
                         layout(par.tp, par.pp, par.dp, par.pp_virtual_stages, par.ep) + f" z{par.zero}",
                         f"{rc}{par.recompute}", row.mbs, row.gbs, f"{row.step_time_s:.2f}" + ("*" if row.derived else ""),
                         f"{est.step_time_s:.2f}", f"{p.error_pct:+.1f}", f"{t['compute']:.2f}", f"{t['recompute']:.2f}",
                         f"{t['ep_comm']:.2f} {est.moe['a2a_link']}", f"{t['tp_comm'] + t['pp_comm']:.2f}",
                         f"{t['bubble']:.2f}", f"{t['zero_comm'] + t['optimizer'] + t['dp_tail']:.2f}",
                         f"{est.peak_memory_bytes / 2**30:.0f}" + ("" if est.fits else " (over)"), twin))
            notes += [f"  {row.name}: {flag}" for flag in p.mapped.flags]
        print(f"megatron_moe_h100.yaml: Megatron-Core MoE on DGX H100, BF16, {title} -- step time (h100-80g-megatron)")
        print(table(["run", "GPUs", "Megatron tp/pp/dp ep", "priced tp/pp/dp ep", "recompute", "mb", "batch",
                     "published s", "predicted s", "error %", "compute", "recompute s", "ep a2a", "tp+p2p", "bubble",
                     "dp+opt", "mem GiB", "what-if tp 1 s"], rows, align="lrllrrrrrrrrrrrrrr"))
        print(summary(errors, f"Megatron MoE {dispatcher}", None, None) + "  (held out, never fitted)")
        print("(* derived from the published TFLOP/s with Megatron's FLOP count; where the plan differs from the run:)")
        print("\n".join(notes + skipped))
        print()


def memory_tables() -> None:
    """Published peak memory (memory_public.yaml) against the cost model's tensor peak on the
    reported stage (target 5 %), and every h100_public.yaml run's predicted peak against the
    device memory of its profile (the runs ran: each should fit)."""
    from autopar.reference_memory import memory_runs, predicted_peak_bytes

    rows, errors = [], []
    for run in memory_runs():
        peak, states = predicted_peak_bytes(run)
        err = pct(peak, run.peak_allocated_bytes)
        errors.append(err)
        rows.append((run.name, run.num_gpus, f"{run.tp}/{run.pp}/{run.dp}" + (f" v{run.virtual_stages}" if run.virtual_stages > 1 else ""),
                     run.micro_batch, run.stage, f"{run.resident_allocated_bytes / 2**30:.2f}", f"{states / 2**30:.2f}",
                     f"{run.peak_allocated_bytes / 2**30:.2f}", f"{peak / 2**30:.2f}", f"{err:+.1f}"))
    print("memory_public.yaml: Megatron-LM functional tests (DGX H100 80GB), peak allocated GiB of the reported stage")
    print(table(["run", "GPUs", "tp/pp/dp", "mb", "stage", "resident pub", "states pred", "peak pub", "peak pred",
                 "error %"], rows))
    print(summary(errors, "memory peaks", None, 5))
    print()
    rows = []
    for run in public_runs():
        cluster, profile = software_cluster(run)
        est = estimate_plan(public_plan(run, profile), run_graph(run), cluster)
        verdict = "yes" if est.fits else f"NO (+{(est.peak_memory_bytes - est.capacity_bytes) / 2**30:.1f} GiB)"
        published, err = "", ""
        if run.published_peak_bytes:
            published = f"{run.published_peak_bytes / 2**30:.1f}"
            err = f"{pct(est.peak_memory_bytes, run.published_peak_bytes):+.1f}"
        rows.append((run.group, run.name, profile, f"{est.peak_memory_bytes / 2**30:.1f}", published, err,
                     f"{est.capacity_bytes / 2**30:.2f}", verdict))
    print("h100_public.yaml: every run ran -- predicted peak GiB (reserve included) against its profile's device memory")
    print(table(["group", "run", "profile", "peak GiB", "published GiB", "error %", "capacity GiB", "fits"], rows,
                align="lllrrrrl"))
    print("(torchtitan: a 96 GB H100 (95.0 GiB to a process), per-op selective recompute; its published figure is the\n"
          " caching allocator's max reserved, autopar's the tensors' peak plus what is held outside them: informational)")
    print()


def holdout_table() -> None:
    """Leave-one-source-out (autopar.reference_fit): per source, the error of its published figures
    with the shipped constants (in-sample: chosen with these runs) and with constants fitted without
    them (held-out), and the constants of each fold."""
    from autopar.reference_fit import FITTED, PREDICTED_WHY, SOURCES, holdout, shipped_values

    folds = holdout(progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True))
    rows = []
    for f in folds:
        def stats(errs: tuple[float, ...]) -> tuple[str, str]:
            return f"{100 * sum(map(abs, errs)) / len(errs):.1f}", f"{100 * max(map(abs, errs)):.1f}"

        fitted = f.source in SOURCES
        rows.append((f.source, len(f.names), *stats(f.in_sample), *stats(f.held_out),
                     "" if fitted else f"never fitted ({PREDICTED_WHY[f.source]})",
                     ", ".join(f"{k} kept" for k in f.kept)))
        # held out only but the same hardware and software family: its target is the acceptance figure
        if fitted or f.source == "korthikanti_t5":
            errs = [abs(e) for e in f.held_out]
            check(sum(errs) / len(errs) <= 0.05, f"held-out {f.source} mean <= 5 %")
            check(max(errs) <= 0.10, f"held-out {f.source} max <= 10 %")
    print("leave one source out: |error| % of each source's published figures (H100 step times; A100: SC21 iteration "
          "times, Table 4 layer fwd/bwd, Table 5 iteration times, torchtitan step times)")
    print(table(["left out", "runs", "in-sample mean", "in-sample max", "held-out mean", "held-out max", "",
                 "constants"], rows, align="lrrrrrll"))
    print()
    shipped = shipped_values()
    consts = [(k.name, ", ".join(k.profiles), f"{shipped[k.name]:.3f}",
               *(f"{f.values[k.name]:.3f}" + ("*" if k.name in f.kept else "") for f in folds)) for k in FITTED]
    rows = [(f.source, name, f"{100 * a:+.1f}", f"{100 * b:+.1f}") for f in folds if f.source not in SOURCES
            for name, a, b in zip(f.names, f.in_sample, f.held_out)]
    print("held-out-only sources, per figure: error % with the shipped constants and with those fitted on every "
          "source of their GPU")
    print(table(["source", "figure", "shipped constants", "held out"], rows, align="llrr"))
    print()
    print("fitted constants: shipped, and fitted without each source (the last columns: on every source of the "
          "held-out-only source's GPU; * kept)")
    gpu = {"torchtitan": "all H100", "korthikanti_t5": "all A100", "torchtitan_a100": "all A100"}
    print(table(["constant", "profiles", "shipped", *(f"w/o {f.source}" if f.source in SOURCES else gpu.get(f.source, "all")
                                                      for f in folds)], consts, align="ll" + "r" * (len(folds) + 1)))
    print()


def ranking_table() -> None:
    """Kendall's tau of the predicted against the published order, per multi-configuration source
    (autopar.reference_rank); target tau >= 0.8 where a source has three or more configurations."""
    from autopar.reference_rank import ranked_sources

    rows = []
    for src in ranked_sources():
        agree, pairs = src.pairs
        for name, pub, pred in zip(src.names, src.published, src.predicted):
            rows.append((src.source, name, src.quantity, f"{pub:.4g}", f"{pred:.4g}", "", ""))
        target = len(src.names) >= 3
        rows[-1] = rows[-1][:5] + (f"{agree}/{pairs}", f"{src.tau:+.2f}" + (check(src.tau >= 0.8, f"tau {src.source}")
                                                                           if target else " (a pair: informational)"))
    print("ranking: the predicted order of each source's configurations against the published one (in-sample sources)")
    print(table(["source", "configuration", "figure", "published", "predicted", "pairs in order", "Kendall tau"],
                rows, align="lllrrrl"))
    print()


# Chunks per GPU of the interleaved schedule SC21 ran the same tp 8 x pp shape with (Table 1: 530B at
# tp 8 x pp 35, 145.6B at tp 8 x pp 8; its 1T at pp 64 was plain 1F1B)
SC21_CHUNKS = {"22B": 1, "175B": 2, "530B": 3, "1T": 1}


def table5_settings() -> None:
    """Korthikanti 2022 Table 5 priced under settings the paper does not state: interleaved as SC21
    ran the same pipeline shapes, and Megatron-LM's gradient-accumulation fusion. Informational: what
    the held-out residual can be made of, never a calibration."""
    import dataclasses

    base = load_cluster("a100-80g-megatron")
    fused = dataclasses.replace(base, fused_grad_accumulation=True)
    rows = []
    for row in table5_rows():
        graph = table5_graph(row)
        chunks = SC21_CHUNKS[row.model]
        for mode in TABLE5_MODES:
            plan = table5_plan(row, mode)
            inter = dataclasses.replace(plan, parallel=dataclasses.replace(
                plan.parallel, pp_virtual_stages=chunks, pp_schedule="interleaved-1f1b" if chunks > 1 else "1f1b"))
            errs = [pct(estimate_plan(p, graph, c).step_time_s, row.time_s(mode))
                    for p, c in ((plan, base), (inter, base), (plan, fused), (inter, fused))]
            rows.append((row.model, mode.replace("_", " "), chunks, *(f"{e:+.1f}" for e in errs)))
    print("Korthikanti 2022 Table 5 under unstated settings -- error % (a100-80g-megatron, shipped constants)")
    print(table(["model", "setting", "SC21 chunks", "as priced", "interleaved", "fused grad acc.", "both"],
                rows, align="llrrrrr"))
    print()


def _verdict(what: str, start: float) -> int:
    """The closing line (FAIL with the targets missed, or PASS) and the exit code."""
    elapsed = time.perf_counter() - start
    if FAILURES:
        print(f"FAIL ({len(FAILURES)} targets missed: {'; '.join(FAILURES)}) in {elapsed:.1f} s")
        return 1
    print(f"PASS: every {what} target met in {elapsed:.1f} s")
    return 0


def main() -> int:
    start = time.perf_counter()
    if "--holdout" in sys.argv[1:]:
        holdout_table()
        return _verdict("held-out", start)
    if "--table5-settings" in sys.argv[1:]:
        table5_settings()
        return 0
    cluster = load_cluster("a100-80g-megatron")
    megatron_table(sc21_cluster())
    table4(cluster)
    table5(cluster)
    table2(cluster)
    zero_table()
    h100_tables()
    torchtitan_a100_table()
    megatron_moe_table()
    memory_tables()
    ranking_table()
    return _verdict("calibration", start)


if __name__ == "__main__":
    raise SystemExit(main())
