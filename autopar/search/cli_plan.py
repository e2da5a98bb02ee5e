"""``autopar plan``: search the fastest plan that fits memory and write it as plan YAML v1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autopar.errors import AutoparError, InfeasibleError
from autopar.plan import DTYPE_BYTES, DTYPES, OPTIMIZERS


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.py", help="model file (see the model-file contract in README)")
    p.add_argument("--gpus", type=_positive, required=True, metavar="N", help="number of GPUs to plan for")
    p.add_argument("--gpus-per-node", type=_positive, metavar="G", help="GPUs per node (default: the profile's)")
    p.add_argument("--cluster", metavar="NAME|PATH",
                   help="cluster profile (default a100-80g, or --profile when it is a full profile; see 'autopar profiles')")
    p.add_argument("--profile", metavar="PATH",
                   help="measured profile (autopar profile): layered over --cluster, or the cluster itself when full")
    p.add_argument("--global-batch", type=_positive, metavar="B",
                   help="sequences per optimizer step (default: the multiple of N nearest 4M tokens)")
    p.add_argument("--micro-batch", type=_int_list, default=(1, 2, 4, 8), metavar="1,2,4,8",
                   help="micro-batch sizes to consider (default 1,2,4,8)")
    p.add_argument("--seq-len", type=_positive, metavar="S", help="tokens per sample (default: the model file's SEQ_LEN)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="training dtype (default bf16)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="optimizer (default adam)")
    p.add_argument("--top", type=_positive, default=5, metavar="K", help="how many plans to rank (default 5)")
    p.add_argument("-o", "--output", metavar="PLAN.yaml",
                   help="where to write the best plan (default plans/<model>-<N>gpu.yaml)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def default_global_batch(num_gpus: int, seq_len: int) -> int:
    """The multiple of ``num_gpus`` closest to 4M tokens per step (at least ``num_gpus``)."""
    target = max(1, round((4 * 2**20) / seq_len))
    return max(num_gpus, round(target / num_gpus) * num_gpus)


def main(args: argparse.Namespace) -> int:
    from autopar.cluster import load_cluster_and_profile
    from autopar.cost.compute import measured_table_warning
    from autopar.graph import build_graph
    from autopar.modelfile import load_model_file
    from autopar.report import gib
    from autopar.search.result import candidate_plan, result_report
    from autopar.search.search import search
    from autopar.search.space import SearchSpace
    from autopar.plan import save_plan

    cluster = load_cluster_and_profile(args.cluster, args.profile, "a100-80g")
    gpn = args.gpus_per_node or cluster.gpus_per_node
    mf = load_model_file(args.model)
    seq = args.seq_len or mf.seq_len or 1
    graph = build_graph(mf, seq_len=args.seq_len, dtype=args.dtype)
    note = measured_table_warning(graph, cluster)
    if note:
        print(f"autopar: warning: {note}", file=sys.stderr)
    gbs = args.global_batch or default_global_batch(args.gpus, seq)
    space = SearchSpace(num_gpus=args.gpus, gpus_per_node=min(gpn, args.gpus), global_batch=gbs, seq_len=seq,
                        micro_batches=tuple(sorted(set(args.micro_batch))), dtype_bytes=DTYPE_BYTES[args.dtype],
                        optimizer=args.optimizer)
    if args.gpus_per_node and args.gpus_per_node != cluster.gpus_per_node:
        import dataclasses

        cluster = dataclasses.replace(cluster, gpus_per_node=args.gpus_per_node)

    def progress(done: int, total: int, elapsed: float) -> None:
        if not args.quiet:
            end = "\n" if done == total else ""
            print(f"\rsearching: {done}/{total} branches, {elapsed:.1f} s", end=end, file=sys.stderr, flush=True)

    result = search(graph, cluster, space, top_k=args.top, progress=progress)
    if not result.top:
        need = result.min_memory_bytes
        raise InfeasibleError(
            f"no plan fits {gib(cluster.memory_bytes)} GiB per GPU on {args.gpus} GPUs: the smallest plan needs "
            f"{gib(need)} GiB; use more GPUs (--gpus), a larger-memory GPU (--cluster h200-141g), "
            f"or a shorter sequence (--seq-len)"
        )
    output = Path(args.output) if args.output else Path("plans") / f"{mf.name}-{args.gpus}gpu.yaml"
    profile_ref = args.cluster or "a100-80g"
    if args.profile and not args.cluster:
        profile_ref = args.profile
    plans = [candidate_plan(c, mf, cluster.name if not Path(profile_ref).suffix else profile_ref, gpn)
             for c in result.top]
    print(result_report(result, plans, graph, cluster, space))
    try:
        save_plan(plans[0], output)
    except OSError as exc:
        raise AutoparError(f"cannot write {output}: {exc.strerror}") from None
    print(f"\nbest plan written to {output}")
    return 0
