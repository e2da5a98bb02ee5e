"""Cost-model accuracy against published measurements (../shared/calibration). Prints four tables:

1. Megatron-LM SC21 Table 1: iteration time of GPT 1.7B-1T on 32-3,072 A100-80GB (target: every row within
   10 %, mean within 5 %), each row's exact configuration estimated with ``--cluster a100-80g``;
2. Korthikanti et al. 2022 Table 4: forward/backward time of one 22B layer (target: 10 %);
3. Korthikanti et al. 2022 Table 2: activation bytes per layer, measured on meta, vs the formulas (target: 2 %);
4. ZeRO SC20 Table 1: model-state GB per device (target: 1 %, or the rounding of the printed figure).

Usage: python benchmarks/calibration.py        (exit code 1 if any target is missed; runs in well under a minute)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.cluster import load_cluster  # noqa: E402
from autopar.cost.estimate import estimate_plan  # noqa: E402
from autopar.cost.memory import state_bytes_per_param  # noqa: E402
from autopar.cost.stage import Config, build_terms  # noqa: E402
from autopar.models.gpt import GPTConfig  # noqa: E402
from autopar.reference import (  # noqa: E402
    KORTHIKANTI_22B, TABLE4_MODES, gpt_graph, load_calibration, megatron_plan, megatron_rows,
)
from autopar.report import table  # noqa: E402

FAILURES: list[str] = []


def pct(predicted: float, published: float) -> float:
    return (predicted / published - 1.0) * 100.0


def check(ok: bool, what: str) -> str:
    if not ok:
        FAILURES.append(what)
    return "" if ok else "  <-- MISS"


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
                     f"{row.iteration_time_s:.2f}", f"{est.step_time_s:.2f}", f"{err:+.1f}" + check(
                         abs(err) <= 10, f"Megatron {row.params_billion}B {err:+.1f} %"),
                     f"{est.mfu * 100:.1f}"))
    print("Megatron-LM SC21 Table 1 (A100-80GB, full recompute, fp16) -- iteration time")
    print(table(["model", "GPUs", "tp/pp/dp", "mb", "batch", "published s", "predicted s", "error %", "MFU %"], rows))
    mean, worst = sum(errors) / len(errors), max(errors)
    print(f"mean |error| {mean:.1f} %   max |error| {worst:.1f} %   (targets: 5 % mean, 10 % each)"
          + check(mean <= 5, f"Megatron mean {mean:.1f} %"))
    print()


def table4(cluster) -> None:  # noqa: ANN001
    graph = gpt_graph(KORTHIKANTI_22B, "fp16")
    data = load_calibration("korthikanti_2022.yaml")["table4_one_layer_of_22B_model_ms"]
    rows = []
    for name, fwd, bwd, total in data["rows"]:
        sp, recompute = TABLE4_MODES[name]
        block = build_terms(graph, cluster, config(tp=8, sequence_parallel=sp, recompute=recompute,
                                                   micro_batch=4)).block
        f, b = block.fwd_s * 1e3, block.bwd_s * 1e3
        ef, eb = pct(f, fwd), pct(b, bwd)
        rows.append((name, f"{fwd:.1f}", f"{f:.2f}", f"{ef:+.1f}" + check(abs(ef) <= 10, f"Table 4 {name} fwd"),
                     f"{bwd:.1f}", f"{b:.2f}", f"{eb:+.1f}" + check(abs(eb) <= 10, f"Table 4 {name} bwd"),
                     f"{total:.1f}", f"{f + b:.2f}"))
    print("Korthikanti 2022 Table 4 -- one layer of the 22B model (h 6144, a 64, s 2048, b 4, t 8), ms")
    print(table(["mode", "pub fwd", "pred fwd", "err %", "pub bwd", "pred bwd", "err %", "pub total", "pred total"],
                rows, align="lrrrrrrrr"))
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
    rows = []
    for s, b, h, a, t in TABLE2_SHAPES:
        graph = gpt_graph(GPTConfig(num_layers=2, hidden_size=h, num_heads=a, seq_len=s, vocab_size=51200), "fp16")
        for mode, (sp, recompute, uses_tp) in TABLE2_MODES.items():
            tp = t if uses_tp else 1
            act = build_terms(graph, cluster, config(tp=tp, sequence_parallel=sp and tp > 1, recompute=recompute,
                                                     micro_batch=b, seq_len=s)).block.act_bytes
            expected = eval(formulas[mode].split("#")[0], {"__builtins__": {}},  # noqa: S307 - shared data file
                            {"s": s, "b": b, "h": h, "a": a, "t": tp})
            err = pct(act, expected)
            rows.append((f"s{s} b{b} h{h} a{a} t{t}", mode, f"{expected / 2**20:,.1f}", f"{act / 2**20:,.1f}",
                         f"{err:+.2f}" + check(abs(err) <= 2, f"Table 2 {mode} s{s} h{h}")))
    print("Korthikanti 2022 Table 2 -- activation MiB per layer per micro-batch (formula vs measured on meta)")
    print(table(["shape", "formula", "published", "autopar", "err %"], rows, align="llrrr"))
    print()


def _gb(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def zero_table() -> None:
    data = load_calibration("zero_sc20_table1.yaml")
    psi = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}
    rows = []
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
            cells.append(f"{published:g} / {_gb(gb)}" + check(abs(gb - published) <= tol, f"ZeRO {col} Nd={nd}"))
        rows.append((nd, *cells))
    print("ZeRO SC20 Table 1 -- model-state GB per device, published/predicted (mixed-precision Adam)")
    print(table(["Nd", *data["columns"][1:]], rows))
    print(f"max relative difference {worst * 100:.2f} % (rounded figures in the paper, e.g. 0.12 for 0.117)")
    print()


def main() -> int:
    start = time.perf_counter()
    cluster = load_cluster("a100-80g")
    megatron_table(cluster)
    table4(cluster)
    table2(cluster)
    zero_table()
    elapsed = time.perf_counter() - start
    if FAILURES:
        print(f"FAIL ({len(FAILURES)} targets missed: {'; '.join(FAILURES)}) in {elapsed:.1f} s")
        return 1
    print(f"PASS: every calibration target met in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
