"""Fuzz the plan loader for >= 5,000 examples per strategy (CI runs a few hundred: tests/unit/test_plan_fuzz.py).

    python benchmarks/fuzz_plans.py [--examples 5000]

Same strategies and property as the unit test: ``parse_plan`` returns a Plan or raises a one-line
PlanError, never anything else, and ``!!python`` tags never run code. Prints one row per strategy
(examples, valid plans, PlanErrors, seconds) and exits 1 on the first counterexample.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("plan_fuzz", HERE.parent / "tests" / "unit" / "test_plan_fuzz.py")
fz = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fz)  # type: ignore[union-attr]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=5000, help="examples per strategy (default 5000)")
    args = ap.parse_args()
    strategies = {
        "mutated plan mappings": fz.mutated_plans().map(fz._dump),
        "mutated YAML text": fz.mutated_text(),
        "random text / documents": st.one_of(st.text(max_size=200), fz.yaml_values.map(fz._dump)),
        "python tags": fz.tagged_text().map(lambda c: c[1]),
    }
    print(f"{'strategy':26s} {'examples':>9s} {'valid':>7s} {'PlanError':>10s} {'seconds':>8s}")
    for name, strategy in strategies.items():
        counts = {"ok": 0, "error": 0}

        @settings(max_examples=args.examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def prop(text: str) -> None:
            counts[fz.check_loader(text)] += 1
            assert not fz.SENTINEL.exists(), "a python tag executed code"

        t0 = time.perf_counter()
        try:
            prop()
        except Exception as exc:  # noqa: BLE001 - report the counterexample
            print(f"{name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        total = counts["ok"] + counts["error"]
        print(f"{name:26s} {total:>9,d} {counts['ok']:>7,d} {counts['error']:>10,d} {time.perf_counter() - t0:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
