"""How long the planner takes to load, graph and estimate large models (all on the meta device, no GPU).

For GPT-3 175B (examples/gpt.py), Llama-3 70B (examples/llama.py) and Megatron's 1T GPT (128 layers, hidden
25600, 160 heads) it prints the seconds spent importing the model file, building the graph (tracing one
block on meta at the shapes the scaling fit needs) and estimating one plan, with the process's peak RSS.
Target: the 1T-parameter GPT in under 10 s in total.

Usage: python benchmarks/load_time.py      (exit code 1 if the 1T model misses the target)
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

T0 = time.perf_counter()
import torch  # noqa: E402,F401 - timed separately: the import is paid once per process

from autopar.cluster import load_cluster  # noqa: E402
from autopar.cost.estimate import estimate_plan  # noqa: E402
from autopar.graph import build_graph  # noqa: E402
from autopar.modelfile import load_model_file  # noqa: E402
from autopar.models.gpt import GPTConfig  # noqa: E402
from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training, load_plan  # noqa: E402
from autopar.reference import gpt_model_path  # noqa: E402
from autopar.report import table  # noqa: E402

IMPORT_S = time.perf_counter() - T0
TARGET_1T_S = 10.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def llama70b_plan(path: Path) -> Plan:
    return Plan(model=ModelRef(file=str(path), num_blocks=80),
                cluster=ClusterRef(profile="h100-80g", num_gpus=256, gpus_per_node=8),
                training=Training(global_batch_size=256, micro_batch_size=1, seq_len=8192),
                parallel=Parallel(dp=8, tp=8, pp=4, sequence_parallel=True, zero=1, recompute="selective"))


def gpt1t_plan(path: Path) -> Plan:
    # Megatron SC21 Table 1's 1T row: tp 8, pp 64, dp 6 on 3,072 A100.
    return Plan(model=ModelRef(file=str(path), num_blocks=128),
                cluster=ClusterRef(profile="a100-80g", num_gpus=3072, gpus_per_node=8),
                training=Training(global_batch_size=3072, micro_batch_size=1, seq_len=2048, dtype="fp16"),
                parallel=Parallel(dp=6, tp=8, pp=64, recompute="full"))


def measure(name: str, path: Path, plan: Plan) -> tuple:
    t0 = time.perf_counter()
    mf = load_model_file(path)
    t1 = time.perf_counter()
    graph = build_graph(mf, seq_len=plan.training.seq_len, dtype=plan.training.dtype)
    t2 = time.perf_counter()
    est = estimate_plan(plan, graph, load_cluster(plan.cluster.profile))
    t3 = time.perf_counter()
    return (name, f"{graph.num_params / 1e9:,.1f}", graph.num_blocks, f"{t1 - t0:.3f}", f"{t2 - t1:.2f}",
            f"{(t3 - t2) * 1e3:.1f}", f"{t3 - t0:.2f}", f"{peak_rss_mib():,.0f}", f"{est.step_time_s:.2f}",
            t3 - t0)


def main() -> int:
    one_t = gpt_model_path(GPTConfig(num_layers=128, hidden_size=25600, num_heads=160, seq_len=2048, vocab_size=51200))
    gpt_plan = load_plan(REPO / "plans" / "gpt3-175b-megatron-64gpu.yaml")
    cases = [  # the 1T model first: it pays the process's one-time tracing warm-up (the pessimistic number)
        ("GPT 1T (Megatron)", one_t, gpt1t_plan(one_t)),
        ("GPT-3 175B", REPO / "examples" / "gpt.py", gpt_plan),
        ("Llama-3 70B", REPO / "examples" / "llama.py", llama70b_plan(REPO / "examples" / "llama.py")),
    ]
    rows = [measure(*case) for case in cases]
    print(f"import torch + autopar: {IMPORT_S:.2f} s (once per process, not counted below)")
    print(table(["model", "params B", "blocks", "load s", "graph s", "estimate ms", "total s", "peak RSS MiB",
                 "step s"], [r[:-1] for r in rows]))
    print("(the first row includes the one-time warm-up of the meta tracer; peak RSS is the whole process)")
    total_1t = rows[0][-1]
    ok = total_1t < TARGET_1T_S
    print(f"1T GPT loaded, graphed and estimated in {total_1t:.2f} s: {'PASS' if ok else 'FAIL'} (target < {TARGET_1T_S:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
