"""What CPU and activation offload buys: the best plan for Llama-3 70B on A100-80GB nodes
at 8 and 16 GPUs, with offload searched and with ``--offload none``, in one table (docs/offload-recompute.md,
"CPU and activation offload"). A point where no plan fits prints the search's message.

Usage: python benchmarks/offload_tradeoff.py [--cluster a100-80g] [--gpus 8,16]   (about a minute)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.report import table
from autopar.search.driver import search_plans

MODEL = Path(__file__).resolve().parent.parent / "examples" / "llama.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="a100-80g")
    ap.add_argument("--gpus", default="8,16")
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    rows = []
    for n in (int(x) for x in args.gpus.split(",")):
        for modes, label in ((None, "searched"), (("none",), "none")):
            constraints = {"offload": modes} if modes else {}
            try:
                found = search_plans(MODEL, gpus=n, cluster=cluster, cluster_ref=args.cluster, top_k=1,
                                     constraints=constraints)
            except AutoparError as exc:
                rows.append((n, label, "-", "-", "-", "-", "-", str(exc).split(":")[0]))
                continue
            c, e = found.result.top[0].config, found.result.top[0].estimate
            host = getattr(e, "host", None)
            rows.append((n, label, c.offload.label, f"dp{c.dp} tp{c.tp} pp{c.pp} cp{c.cp} z{c.zero} {c.recompute}",
                         f"{e.step_time_s:,.1f}", f"{e.tokens_per_s / n:,.0f}",
                         f"{host['host_memory_bytes'] / 2**30:,.1f}" if host else "-", "fits"))
    print(f"Llama-3 70B on {args.cluster} (host: {cluster.host_memory_bytes_per_node / 2**30:,.1f} GiB per node, "
          f"{cluster.host_link_bandwidth_bytes_per_s / 1e9:,.1f} GB/s per GPU)")
    print(table(["GPUs", "offload asked", "offload", "plan", "step s", "tokens/s/GPU", "host GiB/node", "result"],
                rows, align="rlllrrrl"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
