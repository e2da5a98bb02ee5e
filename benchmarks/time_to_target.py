"""Time to target over GPU counts and global batches: the table of ``autopar plan --objective
time-to-target`` (docs/batch-size.md, "Choosing the batch and the GPU count"), and a plot of it
when matplotlib is installed.

Each (GPUs, batch) point is the search ``autopar plan`` runs for it alone (top 5, recompute mixes
solved again), so the table is the command's. Steps at each batch: S(B) = S_min (1 + B_noise / B)
(McCandlish et al. 2018) anchored at --target-steps steps at --at-batch samples.

The default case is GPT-3 175B (examples/gpt.py) on A100-80GB, anchored at GPT-3's own run: 300 B
tokens at 3.2 M tokens a step (1,536 sequences of 2,048), about 93,750 steps, with a noise scale of
4,096 sequences (8.4 M tokens: the order of Kaplan et al. 2020's critical batch, eq. 5.4, near the
end of such a run). ``--zoo NAME`` plans a zoo model's full size (examples/zoo/NAME.py) instead.
Besides the table it prints the point with the fewest GPU-hours and, at each GPU count, what the
default global batch (about 4 M tokens, the batch a throughput plan takes) costs against that
count's best batch. No target: it prints, and exits 1 only when no point has a plan.

    python benchmarks/time_to_target.py [--gpus 64,128,256,512] [--global-batch 256,...,8192]
        [--noise-scale 4096] [--target-steps 93750] [--at-batch 1536] [--model PATH | --zoo NAME]
        [--plot time-to-target.png]                                     (about 40 s on 2 cores)
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autopar import api  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402
from autopar.search import time_to_target as ttt  # noqa: E402
from autopar.search.driver import default_global_batch  # noqa: E402
from autopar.search.sweep import run_sweep, sweep_points  # noqa: E402

DEFAULT_MODEL = REPO / "examples" / "gpt.py"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _model(args: argparse.Namespace, work: Path) -> Path:
    if args.zoo:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from zoo_lib import ZOO_DIR, with_size

        return with_size(ZOO_DIR / f"{args.zoo}.py", "full", work)
    return Path(args.model)


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="model file (default: GPT-3 175B, examples/gpt.py)")
    ap.add_argument("--zoo", metavar="NAME", help="a zoo model at its full size instead (examples/zoo/NAME.py)")
    ap.add_argument("--cluster", default="a100-80g")
    ap.add_argument("--gpus", type=_ints, default=(64, 128, 256, 512))
    ap.add_argument("--global-batch", type=_ints, default=(256, 512, 1024, 2048, 4096, 8192))
    ap.add_argument("--noise-scale", type=float, default=4096.0, help="B_noise, samples")
    ap.add_argument("--target-steps", type=float, default=93_750.0, help="S0: steps to the target at --at-batch")
    ap.add_argument("--at-batch", type=int, default=1536, help="B0, samples")
    ap.add_argument("--plot", default="time-to-target.png", help="the plot, when matplotlib is installed")
    args = ap.parse_args()

    objective = ttt.objective_of(kind="time-to-target", noise_scale=args.noise_scale, noise_scale_from=None,
                                 target_steps=args.target_steps, at_batch=args.at_batch, seq_lens=(None,))
    model = ttt.step_model_of(objective)
    choice = api.choose_cluster(args.cluster)
    with tempfile.TemporaryDirectory() as tmp:
        path = _model(args, Path(tmp))
        shown = f"examples/zoo/{args.zoo}.py" if args.zoo else _relative(path)

        def point(n: int, batch: int | None, seq: int | None):  # noqa: ANN202
            return api.plan_search(str(path), n, choice, global_batch=batch, seq_len=seq, top=5)

        start = time.perf_counter()
        done = run_sweep(sweep_points(args.gpus, args.global_batch, (None,)), point)
        elapsed = time.perf_counter() - start
    rows = ttt.rows_of_sweep(done, model)
    best = ttt.best_index(rows)
    first = next((p.found for p in done if p.found is not None), None)
    print("$ autopar plan " + " ".join(shlex.quote(x) for x in (
        shown, "--gpus", ",".join(map(str, args.gpus)), "--global-batch", ",".join(map(str, args.global_batch)),
        "--objective", "time-to-target", "--noise-scale", f"{args.noise_scale:g}", "--target-steps",
        f"{args.target_steps:g}", "--at-batch", str(args.at_batch), "--quiet"))
          + ("   # at SIZE = \"full\"" if args.zoo else ""))
    if first is not None:
        g, c = first.graph, first.cluster
        print(f"model    {g.name}: {g.num_blocks} blocks    cluster {c.name}: {c.gpus_per_node} GPUs per node, "
              f"{c.memory_bytes / 2**30:,.1f} GiB each\n")
    print(ttt.time_to_target_report(rows, model))
    print(f"\n{len(done)} points planned in {elapsed:,.1f} s")
    if best is None:
        print("no point has a plan that fits")
        return 1
    print(ttt.best_line(rows[best]))
    cheapest = min((r for r in rows if r.gpu_hours is not None), key=lambda r: (r.gpu_hours, r.time_to_target_s))
    print(f"fewest GPU-hours: {cheapest.gpus:,} GPUs at global batch {cheapest.global_batch_samples:,}, "
          f"{cheapest.time_to_target_s / 3600:,.1f} h, {cheapest.gpu_hours:,.0f} GPU-hours")
    seq = first.space.seq_len
    for n in args.gpus:
        mine = [r for r in rows if r.gpus == n and r.time_to_target_s is not None]
        default = default_global_batch(n, seq)
        at_default = next((r for r in mine if r.global_batch_samples == default), None)
        if not mine or at_default is None:
            continue
        fastest = min(mine, key=lambda r: r.time_to_target_s)
        print(f"{n:,} GPUs: the default batch {default:,} takes {at_default.time_to_target_s / 3600:,.1f} h, "
              f"{(at_default.time_to_target_s / fastest.time_to_target_s - 1) * 100:,.0f} % longer than batch "
              f"{fastest.global_batch_samples:,} ({fastest.time_to_target_s / 3600:,.1f} h)")
    try:
        from autopar.explain.plot import plot_time_to_target

        title = f"{first.graph.name} on {first.cluster.name}: time to target (B_noise {args.noise_scale:g} samples)"
        print(f"plot written to {plot_time_to_target(rows, args.plot, title=title)}")
    except AutoparError as exc:  # matplotlib is an optional extra
        print(f"no plot: {exc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
