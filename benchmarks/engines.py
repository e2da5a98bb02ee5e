"""Plans for the engines users run, end to end: for each model and engine, ``plan --engine``, ``export --to``
(checked by the engine's own code where installed: ``export --check``), then ``estimate --from`` on the
exported file, and the two predictions side by side.

    python benchmarks/engines.py                       # GPT-3 175B and Llama-3 70B at 64 H100s, every engine
    python benchmarks/engines.py --models llama --engines torchtitan,deepspeed --gpus 128

Prints one table; the round trip must give back the plan's prediction (|diff| < 0.1 %).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopar import api  # noqa: E402
from autopar.engines import EXPORT_ENGINES, export_config  # noqa: E402
from autopar.engines.check import check_export  # noqa: E402
from autopar.report import plan_brief  # noqa: E402

MODELS = {"gpt": ("GPT-3 175B", ROOT / "examples" / "gpt.py"), "llama": ("Llama-3 70B", ROOT / "examples" / "llama.py")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,llama", help="comma list of gpt, llama")
    ap.add_argument("--engines", default=",".join(EXPORT_ENGINES))
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--cluster", default="h100-80g")
    args = ap.parse_args()
    rows = []
    for key in args.models.split(","):
        title, model = MODELS[key]
        for engine in args.engines.split(","):
            t0 = time.perf_counter()
            found = api.plan_search(model, args.gpus, args.cluster, engine=engine, top=1, warn=lambda m: None)
            search_s = time.perf_counter() - t0
            plan = found.plans[0]
            text = export_config(plan, engine, plan_name=f"{key}.yaml", cluster=found.cluster)
            checked = check_export(plan, engine, text) or "not installed"
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{key}.{engine}"
                path.write_text(text)
                back = api.estimation_from(engine, path, model, plan.cluster.profile, warn=lambda m: None)
            want, got = plan.prediction["step_time_s"], back.estimation.estimate.step_time_s
            rows.append((title, engine, found.cluster.name, plan_brief(plan), want, got, (got / want - 1) * 100,
                         plan.prediction["mfu"] * 100, checked.removeprefix("checked with "), search_s))
            print(f"  {title} / {engine}: done", file=sys.stderr)
    head = ("model", "engine", "priced with", "plan", "plan step s", "--from step s", "diff %", "MFU %",
            "engine's own check", "search s")
    table = [head] + [(r[0], r[1], r[2], r[3], f"{r[4]:.3f}", f"{r[5]:.3f}", f"{r[6]:+.4f}", f"{r[7]:.1f}", r[8],
                       f"{r[9]:.1f}") for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    worst = max(abs(r[6]) for r in rows)
    print(f"\nround trip: largest |diff| {worst:.4f} % ({'PASS' if worst < 0.1 else 'FAIL'}: < 0.1 %)")
    return 0 if worst < 0.1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
