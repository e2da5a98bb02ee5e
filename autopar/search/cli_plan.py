"""``autopar plan``: search the fastest plan that fits memory and write it as plan YAML v1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autopar.cliargs import int_list, positive_int
from autopar.errors import AutoparError
from autopar.plan import DTYPES, OPTIMIZERS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.py", help="model file (see the model-file contract in README)")
    p.add_argument("--gpus", type=positive_int, required=True, metavar="N", help="number of GPUs to plan for")
    p.add_argument("--gpus-per-node", type=positive_int, metavar="G", help="GPUs per node (default: the profile's)")
    p.add_argument("--cluster", metavar="NAME|PATH",
                   help="cluster profile (default a100-80g, or --profile when it is a full profile; see 'autopar profiles')")
    p.add_argument("--profile", metavar="PATH",
                   help="measured profile (autopar profile): layered over --cluster, or the cluster itself when full")
    p.add_argument("--global-batch", type=positive_int, metavar="B",
                   help="samples per optimizer step (default: the multiple of N nearest 4M tokens; "
                        "32 x N for a model without SEQ_LEN)")
    p.add_argument("--micro-batch", type=int_list, default=(1, 2, 4, 8), metavar="1,2,4,8",
                   help="micro-batch sizes to consider (default 1,2,4,8)")
    p.add_argument("--seq-len", type=positive_int, metavar="S", help="tokens per sample (default: the model file's SEQ_LEN)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="training dtype (default bf16)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="optimizer (default adam)")
    p.add_argument("--top", type=positive_int, default=5, metavar="K", help="how many plans to rank (default 5)")
    p.add_argument("-o", "--output", metavar="PLAN.yaml",
                   help="where to write the best plan (default plans/<model>-<N>gpu.yaml)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    from autopar.usercode import add_timeout_argument

    add_timeout_argument(p)


def main(args: argparse.Namespace) -> int:
    from autopar.cluster import load_cluster_and_profile
    from autopar.modelfile import load_model_file
    from autopar.plan import save_plan
    from autopar.search.driver import search_plans
    from autopar.search.result import result_report

    from autopar.modelcheck import check_example_inputs
    from autopar.outputs import check_output_file
    from autopar.usercode import configure

    configure(timeout_s=args.timeout)
    cluster = load_cluster_and_profile(args.cluster, args.profile, "a100-80g")
    mf = load_model_file(args.model)
    check_example_inputs(mf)
    output = Path(args.output) if args.output else Path("plans") / f"{mf.name}-{args.gpus}gpu.yaml"
    check_output_file(output, "-o")  # before the search: never search for a plan that cannot be written
    profile_ref = args.cluster or (args.profile if args.profile else "a100-80g")

    def progress(done: int, total: int, elapsed: float) -> None:
        if not args.quiet:
            end = "\n" if done == total else ""
            print(f"\rsearching: {done}/{total} branches, {elapsed:.1f} s", end=end, file=sys.stderr, flush=True)

    found = search_plans(
        mf, gpus=args.gpus, cluster=cluster,
        cluster_ref=cluster.name if not Path(profile_ref).suffix else profile_ref,
        gpus_per_node=args.gpus_per_node, global_batch=args.global_batch, micro_batches=args.micro_batch,
        seq_len=args.seq_len, dtype=args.dtype, optimizer=args.optimizer, top_k=args.top, progress=progress,
    )
    if found.warning:
        print(f"autopar: warning: {found.warning}", file=sys.stderr)
    print(result_report(found.result, list(found.plans), found.graph, found.cluster, found.space))
    try:
        save_plan(found.plans[0], output)
    except OSError as exc:
        raise AutoparError(f"cannot write {output}: {exc.strerror}") from None
    print(f"\nbest plan written to {output}")
    return 0
