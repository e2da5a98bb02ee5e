"""Plan quality against Megatron SC21 Table 1: autopar's best plan vs the published configuration.

For each row (same model, GPU count, global batch, fp16, a100-80g profile) autopar searches the full
space and the published configuration (full recompute, no SP, ZeRO-0, its tp/pp/micro-batch and
interleaving) is estimated with the same cost model. Target: autopar's predicted iteration time <=
the published configuration's predicted time on every row. Exits 1 if a row misses.

    python benchmarks/plan_quality.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.cluster import load_cluster  # noqa: E402
from autopar.cost.estimate import estimate_plan  # noqa: E402
from autopar.reference import gpt_graph, megatron_plan, megatron_rows  # noqa: E402
from autopar.report import table  # noqa: E402
from autopar.search.search import search  # noqa: E402
from autopar.search.space import SearchSpace  # noqa: E402


def _describe(c) -> str:  # noqa: ANN001
    sched = f" v{c.virtual_stages}" if c.virtual_stages > 1 else ""
    sp = " sp" if c.sequence_parallel else ""
    cp = f" cp{c.cp}-{c.cp_kind}" if c.cp > 1 else ""
    return f"dp{c.dp} tp{c.tp}{sp} pp{c.pp}{sched}{cp} z{c.zero} mb{c.micro_batch} {c.recompute}"


def main() -> int:
    cluster = load_cluster("a100-80g")
    rows, missed = [], []
    for row in megatron_rows():
        graph = gpt_graph(row.config, "fp16")
        published = estimate_plan(megatron_plan(row), graph, cluster)
        space = SearchSpace(num_gpus=row.num_gpus, gpus_per_node=8, global_batch=row.global_batch, seq_len=2048,
                            micro_batches=tuple(sorted({1, 2, 4, 8, row.micro_batch})), dtype_bytes=2)
        t0 = time.perf_counter()
        result = search(graph, cluster, space, top_k=1)
        search_s = time.perf_counter() - t0
        best = result.top[0]
        gain = (published.step_time_s - best.step_time_s) / published.step_time_s * 100
        ok = best.step_time_s <= published.step_time_s * (1 + 1e-9)
        if not ok:
            missed.append(f"{row.params_billion}B")
        rows.append((f"{row.params_billion}B", row.num_gpus, row.global_batch, f"{row.iteration_time_s:.2f}",
                     f"{published.step_time_s:.2f}", f"{best.step_time_s:.2f}", f"{gain:+.1f} %",
                     _describe(best.config), f"{search_s:.1f}", "ok" if ok else "WORSE"))
        print(f"{row.params_billion}B done in {search_s:.1f} s", file=sys.stderr)
    print(table(["model", "GPUs", "batch", "published s", "published cfg predicted s", "autopar best s", "gain",
                 "autopar plan", "search s", ""], rows, align="lrrrrrrlrl"))
    if missed:
        print(f"WORSE than the published configuration: {', '.join(missed)}")
        return 1
    print("PASS: autopar's plan is at least as fast as the published configuration on every row")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
