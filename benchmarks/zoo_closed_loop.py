"""The zoo's closed loop on this machine: ``autopar profile -> plan -> validate`` on every zoo model, on CPU.

For every model file in ``examples/zoo/`` (its tiny size, copied unchanged into a scratch folder) the
three commands of docs/profiles.md ("Your own model on this machine: three commands"), each as a
subprocess ``python -m autopar ...`` with a time limit::

    autopar profile MODEL.py --device cpu -o prof.yaml --micro-batch 1 --tp 1,2 --no-kernels --repeats 3 --warmup 1
    autopar plan MODEL.py --gpus 2 --global-batch 16 --profile prof.yaml -o plan.yaml
    autopar validate plan.yaml MODEL.py --steps 3 --report report.json

(the profile's options keep it short: one micro-batch, no kernel sweeps, fewer repeats; the load
ranks, the contention curve and the collectives are measured as a user's profile measures them).
One row per model: each command's wall seconds, predicted against measured step time and peak memory
(validate's report), and the status:

* ``ok``: the three commands completed;
* ``refused``: a command ended with autopar's one-line error and exit 2 (a stated limitation);
* ``FAIL``: a traceback, another exit code, a timeout, or validate wrote no report;
* ``n/a``: an optional package the model needs is not installed.

Models run one after another (a failure costs only its own row). Nothing is written into the
repository. Exit 1 if any model fails.

    python benchmarks/zoo_closed_loop.py                          # the whole zoo
    python benchmarks/zoo_closed_loop.py --models hf_llama,vit --failures /tmp/zoo_loop_failures.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo_lib import ZOO_DIR, ZooError, ZooModel, _run, _short, failure_excerpt, one_line_cause, with_size, zoo_models

PROFILE_ARGS = ("--device", "cpu", "--micro-batch", "1", "--tp", "1,2", "--no-kernels", "--repeats", "3", "--warmup", "1")
# validate takes the median of steps 2-N: steps of tens of ms on a shared CPU need more than two
GPUS, GLOBAL_BATCH, STEPS = 2, 16, 12
TIMEOUTS_S = {"profile": 300.0, "plan": 180.0, "validate": 240.0}
STEP_NAMES = ("profile", "plan", "validate")


@dataclass(kw_only=True)
class Row:
    name: str
    status: str = "ok"  # ok | refused | FAIL | n/a
    seconds: dict[str, float] = field(default_factory=dict)
    detail: str = ""  # the failing step and its one-line cause
    tail: str = ""
    report: dict = field(default_factory=dict)


def commands(model: Path, work: Path, args: argparse.Namespace) -> dict[str, list[str]]:
    py = [sys.executable, "-m", "autopar"]
    return {
        "profile": py + ["profile", model.name, *PROFILE_ARGS, "-o", "prof.yaml"],
        "plan": py + ["plan", model.name, "--gpus", str(args.gpus), "--global-batch", str(args.global_batch),
                      "--profile", "prof.yaml", "-o", "plan.yaml"],
        "validate": py + ["validate", "plan.yaml", model.name, "--steps", str(args.steps), "--report", "report.json"],
    }


def run_model(m: ZooModel, args: argparse.Namespace) -> Row:
    row = Row(name=m.name)
    missing = m.missing()
    if missing:
        row.status, row.detail = "n/a", missing
        return row
    with tempfile.TemporaryDirectory(prefix=f"zoo-loop-{m.name}-") as tmp:
        work = Path(tmp)
        model = with_size(m.path, "tiny", work)
        for step, cmd in commands(model, work, args).items():
            try:
                code, out, secs = _run(cmd, TIMEOUTS_S[step] * args.timeout_scale, work)
            except ZooError as exc:
                row.status, row.detail, row.tail = "FAIL", f"{step}: {exc.cause}", exc.tail
                return row
            row.seconds[step] = secs
            traceback = "Traceback (most recent call last)" in out
            if code == 2 and not traceback:
                row.status, row.detail = "refused", f"{step}: {_short(one_line_cause(out, code))}"
                row.tail = failure_excerpt(out)
                return row
            if code != 0 or traceback:
                why = f"exit {code}" + (", traceback" if traceback else "")
                row.status, row.detail = "FAIL", f"{step}: {why}: {_short(one_line_cause(out, code))}"
                row.tail = failure_excerpt(out)
                return row
        report = work / "report.json"
        if not report.exists():
            row.status, row.detail = "FAIL", "validate: exit 0 but no report written"
            return row
        row.report = json.loads(report.read_text(encoding="utf-8"))
    return row


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def format_table(rows: list[Row]) -> str:
    head = ["model", "profile s", "plan s", "validate s", "pred step s", "meas step s", "err",
            "pred MiB", "meas MiB", "err", "status"]
    body, notes = [], []
    for r in rows:
        st, mem = r.report.get("step_time_s", {}), r.report.get("peak_memory_bytes", {})
        status = r.status
        if r.detail:
            notes.append(f"[{len(notes) + 1}] {r.name}: {r.status}: {r.detail}")
            status = f"{status}[{len(notes)}]"
        body.append([
            r.name, *(_fmt_s(r.seconds.get(s)) for s in STEP_NAMES),
            f"{st['predicted']:.4f}" if st else "-", f"{st['measured']:.4f}" if st else "-",
            f"{st['error_pct']:+.0f}%" if st else "-",
            f"{mem['predicted'] / 2**20:.1f}" if mem else "-", f"{mem['measured'] / 2**20:.1f}" if mem else "-",
            f"{mem['error_pct']:+.1f}%" if mem else "-", status])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    right = set(range(1, len(head) - 1))

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
    out += ["", "columns: wall seconds of each command; step time (s) and peak memory (MiB) as validate reports them, "
            "error = (measured - predicted) / predicted; measured on a shared CPU machine (timings noisy)"]
    return "\n".join(out + ([""] + notes if notes else []))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", help=f"comma-separated model names (default: every file in {ZOO_DIR.name}/)")
    p.add_argument("--gpus", type=int, default=GPUS, help=f"ranks to plan for and validate on (default {GPUS})")
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, help=f"plan's --global-batch (default {GLOBAL_BATCH})")
    p.add_argument("--steps", type=int, default=STEPS, help=f"validate's --steps (default {STEPS})")
    p.add_argument("--timeout-scale", type=float, default=1.0,
                   help="multiply each command's time limit (profile 300 s, plan 180 s, validate 240 s)")
    p.add_argument("--failures", help="append each failure's output excerpt to this Markdown file")
    args = p.parse_args(argv)
    try:
        models = zoo_models(args.models.split(",") if args.models else None)
    except ValueError as exc:
        p.error(str(exc))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    start = time.perf_counter()
    print(f"zoo closed loop: {len(models)} models, {args.gpus} ranks, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    rows = []
    for m in models:
        t0 = time.perf_counter()
        r = run_model(m, args)
        rows.append(r)
        print(f"  {m.name} ({time.perf_counter() - t0:.0f} s): {r.status}{': ' + r.detail if r.detail else ''}",
              file=sys.stderr, flush=True)
        if args.failures and r.status in ("FAIL", "refused"):
            with open(args.failures, "a", encoding="utf-8") as fh:
                fh.write(f"### {r.name} ({stamp}) — {r.status}: {r.detail}\n\n```\n{r.tail}\n```\n\n")
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "refused", "FAIL", "n/a")}
    failed = [r.name for r in rows if r.status == "FAIL"]
    print(format_table(rows))
    print(f"\nzoo closed loop: {len(rows)} models, {counts['ok']} ok, {counts['refused']} refused, {counts['FAIL']} FAIL, "
          f"{counts['n/a']} n/a; failed: {', '.join(failed) or 'none'} ({time.perf_counter() - start:.0f} s, "
          f"started {stamp})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
