"""Search time of `autopar plan` for GPT-3 175B and Llama-3 70B / 405B from 8 to 16,384 GPUs.

Targets on the 2-core development machine: <= 2 s at 64 GPUs, <= 20 s at 16,384 GPUs (the search
itself; loading and graphing the model is printed separately). Prints one table; exits 1 if a
target is missed.

    python benchmarks/search_time.py [--gpus 8,64,...] [--models gpt3-175b,llama3-70b,llama3-405b]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autopar.cluster import load_cluster  # noqa: E402
from autopar.graph import build_graph  # noqa: E402
from autopar.models.llama import LlamaConfig, model_file  # noqa: E402
from autopar.report import gib, table  # noqa: E402
from autopar.search.driver import default_global_batch  # noqa: E402
from autopar.search.search import search  # noqa: E402
from autopar.search.space import SearchSpace  # noqa: E402

LLAMA3_405B = LlamaConfig(num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8, ffn_hidden_size=53248,
                          seq_len=8192, vocab_size=128256)
TARGETS_S = {64: 2.0, 16384: 20.0}


def _model_path(name: str) -> str:
    if name == "gpt3-175b":
        return str(REPO / "examples" / "gpt.py")
    if name == "llama3-70b":
        return str(REPO / "examples" / "llama.py")
    if name == "llama3-405b":
        import tempfile

        path = Path(tempfile.gettempdir()) / "autopar-models" / "llama3_405b.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(model_file(LLAMA3_405B), encoding="utf-8")
        return str(path)
    raise SystemExit(f"unknown model {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="8,64,512,1024,4096,16384")
    parser.add_argument("--models", default="gpt3-175b,llama3-70b,llama3-405b")
    args = parser.parse_args()
    cluster = load_cluster("a100-80g")
    rows, missed = [], []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        graph = build_graph(_model_path(name))
        graph_s = time.perf_counter() - t0
        for n in (int(x) for x in args.gpus.split(",")):
            space = SearchSpace(num_gpus=n, gpus_per_node=cluster.gpus_per_node,
                                global_batch=default_global_batch(n, graph.seq_len), seq_len=graph.seq_len,
                                micro_batches=(1, 2, 4, 8))
            t1 = time.perf_counter()
            result = search(graph, cluster, space, top_k=5)
            search_s = time.perf_counter() - t1
            if result.top:
                c = result.top[0].config
                best = (f"dp{c.dp} tp{c.tp} pp{c.pp} cp{c.cp} z{c.zero} mb{c.micro_batch} {c.recompute}"
                        f"{' v' + str(c.virtual_stages) if c.virtual_stages > 1 else ''}")
                step, mfu = f"{result.top[0].step_time_s:,.2f}", f"{result.top[0].estimate.mfu * 100:.1f}"
            else:
                best, step, mfu = f"no plan fits (needs {gib(result.min_memory_bytes)} GiB)", "-", "-"
            target = TARGETS_S.get(n)
            ok = "" if target is None else ("ok" if search_s <= target else "MISSED")
            if ok == "MISSED":
                missed.append(f"{name}@{n}")
            rows.append((name, n, space.global_batch, f"{graph_s:.2f}", f"{search_s:.2f}",
                         f"{result.num_configs:,}", f"{result.num_ilp_solved:,}", best, step, mfu,
                         f"<= {target:.0f} s {ok}" if target else ""))
            print(f"{name} @ {n} GPUs: {search_s:.2f} s", file=sys.stderr)
    print(table(["model", "GPUs", "global batch", "graph s", "search s", "configs", "ILPs", "best plan", "step s",
                 "MFU %", "target"], rows, align="lrrrrrrlrrl"))
    if missed:
        print(f"MISSED: {', '.join(missed)}")
        return 1
    print("PASS: search-time targets met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
