"""Planning models that do not repeat one block at full size on 64 GPUs: ResNet-152 (a chain of 50
residual blocks in 4 stages of different widths), ViT-H/14 (32 blocks in an nn.Sequential, bare
class token and position table) and T5-large (24 + 24 encoder/decoder blocks; needs transformers).

For each: the units and measured kinds, seconds to measure the graph and to search, the best plan,
the best plan with pp > 1 and its partition (units per rank), and why PP is not offered where it
is not. Target: graph + search under 60 s per model on the 2-core development machine;
exits 1 if a target is missed.

    python benchmarks/chain_plan.py [--gpus 64] [--models resnet,vit,t5]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autopar.cluster import load_cluster  # noqa: E402
from autopar.graph import build_graph  # noqa: E402
from autopar.modelfile import load_model_file  # noqa: E402
from autopar.report import table  # noqa: E402
from autopar.search.driver import default_global_batch  # noqa: E402
from autopar.search.search import search  # noqa: E402
from autopar.search.space import SearchSpace  # noqa: E402

ZOO = REPO / "examples" / "zoo"
MODELS = {"resnet": "resnet.py", "vit": "vit.py", "t5": "hf_t5.py"}
TARGET_S = 60.0


def _full_size(name: str, out_dir: Path) -> Path:
    text = (ZOO / MODELS[name]).read_text().replace('SIZE = "tiny"', 'SIZE = "full"')
    path = out_dir / f"{name}_full.py"
    path.write_text(text)
    return path


def _plan_text(c) -> str:  # noqa: ANN001
    return f"dp{c.config.dp} pp{c.config.pp} zero{c.config.zero} mb{c.config.micro_batch} {c.config.recompute}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--models", default="resnet,vit,t5")
    args = ap.parse_args()
    cluster = load_cluster("a100-80g")
    rows, missed = [], False
    with tempfile.TemporaryDirectory(prefix="autopar-chain-bench-") as tmp:
        for name in args.models.split(","):
            if name == "t5" and importlib.util.find_spec("transformers") is None:
                rows.append((name, "-", "-", "-", "-", "-", "-", "transformers not installed"))
                continue
            mf = load_model_file(_full_size(name, Path(tmp)))
            start = time.perf_counter()
            graph = build_graph(mf, dtype="bf16")
            graph_s = time.perf_counter() - start
            seq = graph.seq_len
            space = SearchSpace(num_gpus=args.gpus, gpus_per_node=8, global_batch=default_global_batch(args.gpus, seq),
                                seq_len=seq, micro_batches=(1, 2, 4, 8))
            result = search(graph, cluster, space, top_k=5)  # what `autopar plan` searches
            best = result.top[0]
            pp = next((c for c in result.top if c.config.pp > 1), None)
            if pp is None and graph.supports("pp") is None:  # deeper ranking, untimed, to show a partition
                pp = next((c for c in search(graph, cluster, space, top_k=400).top if c.config.pp > 1), None)
            kinds = len({u.region for u in graph.chain}) if graph.chain else 1
            pp_text = (f"{_plan_text(pp)}: {'/'.join(map(str, pp.chunk_blocks))} ({pp.step_time_s * 1e3:.1f} ms)"
                       if pp else f"not offered: {graph.supports('pp')}" if graph.supports("pp") else "none fits")
            total = graph_s + result.elapsed_s
            missed |= total > TARGET_S
            rows.append((name, f"{graph.num_params / 1e6:,.0f} M", f"{graph.num_blocks} / {kinds}",
                         f"{graph_s:.1f}", f"{result.elapsed_s:.2f}", f"{_plan_text(best)} ({best.step_time_s * 1e3:.1f} ms)",
                         f"{total:.1f}" + (" MISSED" if total > TARGET_S else ""), pp_text))
    print(table(["model", "params", "units / kinds", "graph s", "search s", "best plan", "total s", "best pp plan"],
                rows, align="lrrrrlrl"))
    print(f"target: graph + search <= {TARGET_S:.0f} s per model at {args.gpus} GPUs")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
