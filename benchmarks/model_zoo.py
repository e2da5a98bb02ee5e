"""The model zoo: autopar on models it did not write, unchanged (the zoo's acceptance table).

For every model file in ``examples/zoo/`` one row:

* ``plan64``: wall seconds of ``autopar plan FILE --gpus 64`` on the file's full size (a copy with
  ``SIZE = "full"``), as a subprocess with a 90 s limit; a timeout or a non-zero exit is a failure;
* ``tp sp pp cp zero3 ep``: whether autopar offers the dimension for this model (the reason when not);
* ``dp2 tp2+sp pp2 cp2 zero3 ep2``: the tiny size trained 3 steps on 2 CPU ranks (gloo) under a plan of that
  dimension, against the same model on one rank: every step's loss within 1e-4 (relative). A dimension
  that is not offered is ``n/a``; ``tp2+sp`` runs tp2 alone when tp is offered without SP.

Every cell is ``ok``, ``FAIL[n]`` or ``n/a[n]``; note ``[n]`` under the table gives the one-line cause or
reason. Exit 1 if any cell fails. Runs are sequential by default (``--jobs``), each with a time limit.

    python benchmarks/model_zoo.py                          # the whole zoo
    python benchmarks/model_zoo.py --models hf_llama,vit --dims dp2,pp2
    python benchmarks/model_zoo.py --out notes/zoo_matrix.txt --failures notes/zoo_failures.md
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo_lib import RUNS, SUPPORT_KEYS, ZOO_DIR, Cell, ModelResult, evaluate, zoo_models

PLAN_GOAL_S = 60.0  # the zoo's goal: planning any zoo model ends in under 60 s (the cell's time limit is 90 s)


def _header(col: str) -> str:
    return col.split(":", 1)[1] + ("?" if col.startswith("offer:") else "") if ":" in col else col


def format_table(results: list[ModelResult], dims: list[str]) -> str:
    cols = ["plan64"] + [f"offer:{k}" for k in SUPPORT_KEYS] + [f"run:{d}" for d in dims]
    notes: list[str] = []
    note_ids: dict[str, int] = {}
    rows = []
    for r in results:
        cells = r.cells()
        row = [r.model.name]
        for col in cols:
            c = cells[col]
            text = c.status + ("*" if c.missing_offer else "")
            if col == "plan64" and c.status == "ok":
                text = f"{c.seconds:.1f} s" + ("!" if c.seconds > PLAN_GOAL_S else "")
            elif c.detail and not (c.status == "ok"):
                key = f"{c.status} {c.detail}"
                if key not in note_ids:
                    note_ids[key] = len(notes) + 1
                    notes.append(f"[{note_ids[key]}] {c.status}: {c.detail}")
                text = f"{text}[{note_ids[key]}]"
            elif c.detail:
                text = f"ok ({c.detail})"
            row.append(text)
        rows.append(row)
    head = ["model"] + [_header(c) for c in cols]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in rows]
    lines += ["", f"columns: plan64 = autopar plan of the full size at 64 GPUs (s; '!' = over the {PLAN_GOAL_S:.0f} s goal); "
              "tp? .. ep? = offered by "
              "autopar; dp2 .. ep2 = 2 CPU ranks vs 1 rank, 3 steps, losses within 1e-4; n/a* = not offered "
              "although the zoo expects it (zoo_lib.expected_offers)", ""]
    lines += notes
    return "\n".join(lines)


def summary(results: list[ModelResult], strict_offers: bool = False) -> tuple[str, int]:
    """The summary line and the number of failures (missing expected offers count with --strict-offers)."""
    counts = {"ok": 0, "FAIL": 0, "n/a": 0}
    missing = 0
    for r in results:
        for c in r.cells().values():
            counts[c.status] += 1
            missing += c.missing_offer
    failed_models = [r.model.name for r in results if any(c.failed for c in r.cells().values())]
    line = (f"zoo: {len(results)} models, {counts['ok']} ok, {counts['FAIL']} FAIL, {counts['n/a']} n/a cells "
            f"({missing} expected offers missing); models with a failure: {', '.join(failed_models) or 'none'}")
    return line, counts["FAIL"] + (missing if strict_offers else 0)


def failure_log(results: list[ModelResult]) -> str:
    """Markdown: per model, each distinct cause once, with the cells it failed and an output excerpt."""
    out = []
    for r in results:
        by_cause: dict[str, list[tuple[str, Cell]]] = {}
        for col, c in r.cells().items():
            if c.failed:
                by_cause.setdefault(c.detail, []).append((col, c))
        for detail, cells in by_cause.items():
            out.append(f"### {r.model.name} — {', '.join(col for col, _ in cells)}: {detail}\n")
            tail = next((c.tail for _, c in cells if c.tail), "")
            if tail:
                out.append("```\n" + tail + "\n```\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", help=f"comma-separated model names (default: every file in {ZOO_DIR.name}/)")
    p.add_argument("--dims", default=",".join(RUNS), help=f"run cells to try (default {','.join(RUNS)})")
    p.add_argument("--jobs", type=int, default=1, help="models evaluated at once (default 1: sequential)")
    p.add_argument("--gpus", type=int, default=64, help="GPUs to plan the full size for (default 64)")
    p.add_argument("--no-plan", action="store_true", help="skip the full-size planning column")
    p.add_argument("--out", help="also write the table and summary to this file (overwritten)")
    p.add_argument("--strict-offers", action="store_true",
                   help="count a dimension the zoo expects offered (n/a*) as a failure")
    p.add_argument("--failures", help="append each failure's cause and output tail to this Markdown file")
    args = p.parse_args(argv)
    dims = [d for d in args.dims.split(",") if d]
    bad = [d for d in dims if d not in RUNS]
    if bad or args.jobs < 1:
        p.error(f"--dims takes {','.join(RUNS)}; got {','.join(bad)}" if bad else "--jobs must be >= 1")
    try:
        models = zoo_models(args.models.split(",") if args.models else None)
    except ValueError as exc:
        p.error(str(exc))
    start = time.perf_counter()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    done: dict[str, ModelResult] = {}
    lock = threading.Lock()
    if args.failures:
        with open(args.failures, "a", encoding="utf-8") as fh:
            fh.write(f"\n## model_zoo run {stamp} ({len(models)} models, dims {','.join(dims)})\n\n")

    def one(m):
        t0 = time.perf_counter()
        r = evaluate(m, dims=dims, plan=not args.no_plan, gpus=args.gpus)
        took = f"({time.perf_counter() - t0:.0f} s)"
        causes: dict[str, list[str]] = {}
        for k, c in r.cells().items():
            if c.failed:
                causes.setdefault(c.detail, []).append(k)
        bad_cells = [f"{','.join(ks)}: {d}" for d, ks in causes.items()]
        print(f"  {m.name} {took}: {'FAIL ' + '; '.join(bad_cells) if bad_cells else 'no failures'}", file=sys.stderr,
              flush=True)
        with lock:  # the files show the models finished so far, so a long run can be read while it goes
            done[m.name] = r
            if args.failures and bad_cells:
                with open(args.failures, "a", encoding="utf-8") as fh:
                    fh.write(failure_log([r]) + "\n")
            if args.out:
                partial = [done[x.name] for x in models if x.name in done]
                Path(args.out).write_text(
                    f"{format_table(partial, dims)}\n\n(partial: {len(partial)} of {len(models)} models, started "
                    f"{stamp})\n", encoding="utf-8")
        return r

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(one, models))
    table = format_table(results, dims)
    line, failures = summary(results, args.strict_offers)
    text = f"{table}\n\n{line} ({time.perf_counter() - start:.0f} s, started {stamp})"
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
