"""``autopar rehearse PLAN.yaml [MODEL.py] [--ranks R,R,...] [--json]``: the real executor applied to
chosen ranks of a plan at its full world size, on one CPU machine, and each rank's measured peak
memory beside the cost model's (docs/rehearse.md)."""

from __future__ import annotations

import argparse
import json
import sys

from autopar.commands.args import positive_int, warn


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN.yaml", help="plan file (YAML v1)")
    p.add_argument("model", metavar="MODEL.py", nargs="?", help="model file (default: the plan's model.file)")
    p.add_argument("--ranks", type=_ranks, metavar="R,R,...",
                   help="global ranks to rehearse (default: the first rank of every pipeline stage)")
    p.add_argument("--cluster", metavar="NAME|PATH", help="cluster profile of the prediction and the capacity "
                                                          "(default: the plan's cluster.profile)")
    p.add_argument("--profile", metavar="PATH", help="measured profile layered over the cluster profile")
    p.add_argument("--workers", type=positive_int, metavar="N",
                   help="ranks rehearsed at once, one process each (default: the CPU cores)")
    p.add_argument("--why", type=positive_int, metavar="N", default=0,
                   help="also list, per rank, the N largest groups of tensors alive at its peak: their part, "
                        "the op that made them and the module it ran in")
    p.add_argument("--json", action="store_true", help="print one JSON object (ranks, capacity_bytes, fits)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--no-cache", action="store_true",
                   help="trace the model file again instead of reading its graph from the cache (~/.cache/autopar)")


def _ranks(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ranks, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected ranks >= 0, got {text!r}")
    return values


def main(args: argparse.Namespace) -> int:
    from autopar import api
    from autopar.rehearse import format_rehearsal, rehearsal_json
    from autopar.usercode import stdout_to_stderr

    def progress(text: str) -> None:
        if not args.quiet:
            print(f"rehearse: {text}", file=sys.stderr, flush=True)

    with stdout_to_stderr():  # the model file's prints never mix with the table or the JSON
        reh = api.rehearsal(args.plan, args.model, args.cluster, ranks=args.ranks, profile=args.profile,
                            workers=args.workers, progress=progress, use_cache=not args.no_cache, warn=warn,
                            why=args.why)
    print(json.dumps(rehearsal_json(reh), indent=2) if args.json else format_rehearsal(reh))
    return 0


