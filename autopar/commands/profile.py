"""``autopar profile``: measure this machine and write (or update) a cluster profile.

    autopar profile MODEL.py [--device cpu|cuda] [--micro-batch 1,2,4] [--tp 1,2] [--cp 1,2]
                    [--threads N] [--dtype fp32] [--load-ranks N] [--no-comm] -o profiles/NAME.yaml
    autopar profile --comm --nproc-per-node N -o profiles/NAME.yaml      (starts N ranks here)
    torchrun --nproc-per-node N -m autopar profile --comm -o profiles/NAME.yaml

On CPU the layers are timed as one of ``--load-ranks`` ranks sharing the machine (default: one
per core, the concurrency of a CPU run here), and the collectives are then measured on that many
ranks too, so ``autopar profile MODEL.py --device cpu -o P.yaml`` alone makes a profile that plans
and validates honestly on this machine. The file records these conditions (``measured.device``:
dtype, threads, concurrent ranks, cores, torch); ``plan``, ``estimate`` and ``validate`` check a
plan against them (autopar.profile_conditions).

The output is a cluster profile (CONTRACT: existing keys keep their meaning) with a ``measured:``
section (docs/profiles.md). An existing file is updated in place: only the sections measured by
this call are replaced, everything else is kept. A new file also gets ``gpu``, ``network`` and
``efficiency`` sections derived from the measurements, so it works as ``--cluster`` on its own.

A model that fails on real tensors -- its forward, loss or backward, while timing, measuring
memory or training alongside as a load helper -- ends the command as ``autopar plan`` ends on a
model that fails on meta: one line naming the file, what was being measured and the exception,
exit 2, the helpers stopped and no profile written (``ModelFile.running``, autopar.usercode).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autopar.commands.args import int_list
from autopar.errors import AutoparError
from autopar.profiler.cores import usable_cores


def _kind_list(text: str) -> tuple[str, ...]:
    kinds = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [k for k in kinds if k not in ("ring", "allgather", "ulysses")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown cp kind {bad[0]!r}; one of ring, allgather, ulysses")
    return kinds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.py", nargs="?", help="model file whose layers to time (not with --comm)")
    p.add_argument("-o", "--output", metavar="PATH", required=True, help="profile YAML to write or update")
    p.add_argument("--device", choices=("cpu", "cuda"), help="device to measure (default: cuda if available)")
    p.add_argument("--micro-batch", type=int_list, default=(1, 2, 4), metavar="1,2,4", help="micro-batch sizes")
    p.add_argument("--tp", type=int_list, default=(1, 2), metavar="1,2", help="tensor-parallel degrees to shard the block for")
    p.add_argument("--cp", type=int_list, default=(1, 2), metavar="1,2",
                   help="context-parallel degrees: the block is also timed at SEQ_LEN / cp tokens")
    p.add_argument("--cp-kind", type=_kind_list, default=("ring", "allgather", "ulysses"), metavar="ring,allgather,ulysses",
                   help="cp > 1: also time the block with the executor's cp attention of these kinds (default all)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="training dtype (default fp32 on cpu, bf16 on cuda)")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads (torch.set_num_threads); default 1 on cpu")
    p.add_argument("--repeats", type=int, default=7, metavar="R", help="timed runs per shape (median; default 7)")
    p.add_argument("--warmup", type=int, default=3, metavar="W", help="untimed runs first (default 3)")
    p.add_argument("--no-kernels", action="store_true", help="skip the GEMM and memory-bandwidth sweeps")
    p.add_argument("--load-ranks", type=int, metavar="N",
                   help="measure as one of N ranks sharing this machine: N-1 helper processes train the same "
                        "block alongside, as the other ranks of a CPU run do (default on cpu: one rank per core, "
                        f"here {usable_cores()}; on cuda 1)")
    p.add_argument("--no-comm", action="store_true",
                   help="cpu: do not also measure the collectives on --load-ranks ranks (done by default)")
    p.add_argument("--comm", action="store_true",
                   help="profile collectives (and FSDP2's time per parameter tensor) on N ranks instead of layers")
    p.add_argument("--nproc-per-node", type=int, metavar="N", help="with --comm: start N ranks on this host")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="network.gpus_per_node of a new profile (default: ranks)")
    from autopar.usercode import add_timeout_argument

    add_timeout_argument(p)


def main(args: argparse.Namespace) -> int:
    if args.comm:
        from autopar.commands.profile_comm import comm_main

        return comm_main(args)
    if not args.model:
        raise AutoparError("autopar profile needs MODEL.py (or --comm to profile collectives)")
    if args.nproc_per_node:
        raise AutoparError("--nproc-per-node goes with --comm; layer profiling runs in this process")
    from autopar.outputs import check_output_file
    from autopar.usercode import configure

    configure(timeout_s=args.timeout)
    check_output_file(args.output, "-o")  # before minutes of measuring
    return _layers_main(args)


def _layers_main(args: argparse.Namespace) -> int:
    import torch

    from autopar.modelfile import load_model_file
    from autopar.profile_tables import layer_table_to_dict
    from autopar.profiler.kernels import profile_kernels
    from autopar.profiler.layers import LayerProfileConfig, profile_layers
    from autopar.profiler.load import check_load, start_load, stop_load, wait_ready
    from autopar.profiler.profile_file import derived_spec, device_info, read_profile, write_profile
    from autopar.profiler.whole import apply_whole_model, whole_model_rows

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise AutoparError("--device cuda: no CUDA device is available here; use --device cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("fp32" if device.type == "cpu" else "bf16")
    if args.repeats < 1 or args.warmup < 0:
        raise AutoparError("--repeats must be >= 1 and --warmup >= 0")
    # A CPU run puts its single-threaded ranks on these cores: measure as one of them (one per core)
    load_ranks = args.load_ranks or (usable_cores() if device.type == "cpu" else 1)
    if load_ranks < 1:
        raise AutoparError(f"--load-ranks must be >= 1, got {load_ranks}")
    mf = load_model_file(args.model)
    out = Path(args.output)
    data = read_profile(out)
    info = device_info(device, torch.get_num_threads(), dtype=dtype, concurrent_ranks=load_ranks)
    measured = dict(data.get("measured") or {})
    old = measured.get("model") or {}
    if old.get("sha256") and old.get("sha256") != mf.sha256:
        print(f"autopar profile: replacing the layer table of {old.get('name')} in {out}", file=sys.stderr)
    log = lambda s: print(f"autopar profile: {s}", file=sys.stderr, flush=True)  # noqa: E731
    cfg = LayerProfileConfig(micro_batches=args.micro_batch, tps=args.tp, cps=args.cp, dtype=dtype,
                             cp_kinds=getattr(args, "cp_kind", LayerProfileConfig.cp_kinds),
                             ranks_per_machine=load_ranks,
                             warmup=args.warmup, repeats=args.repeats)
    if load_ranks > 1 and device.type == "cpu":
        log(f"timing as one of {load_ranks} ranks on {usable_cores()} cores ({load_ranks - 1} helper(s) "
            "train the block alongside)")
    helpers = start_load(load_ranks - 1, device.type, args.model, max(args.micro_batch))
    try:
        wait_ready(helpers)
        table = profile_layers(mf, device, cfg, log=log)
        # CPU: the whole model against the table's composition, one factor per micro-batch (whole.py)
        whole = whole_model_rows(mf, device, table, tuple(args.micro_batch), dtype, warmup=args.warmup,
                                 repeats=args.repeats, log=log)
        if whole:
            table = apply_whole_model(table, whole)
        kernels = None if args.no_kernels else profile_kernels(device, dtype, optimizer_shapes=_param_shapes(mf))
        if kernels is not None and device.type == "cuda" and dtype in ("bf16", "fp16"):  # flash is 16-bit only
            from autopar.profiler.attention_kernels import attention_curve

            kernels["attention"] = attention_curve(device, dtype)
        check_load(helpers)  # a helper whose model failed: its one line, and no profile timed without its load
    except ValueError as exc:
        raise AutoparError(str(exc)) from None
    finally:
        stop_load(helpers)
    if device.type == "cpu":  # the ranks of other runs: how the compute scales with them
        from autopar.profiler.contention import curve_ranks, measure_contention

        info["contention"] = measure_contention(mf, max(args.micro_batch), curve_ranks(usable_cores(), load_ranks),
                                                dtype=dtype, repeats=args.repeats, log=log)
    measured["device"] = info
    measured["model"], measured["layers"] = layer_table_to_dict(table)
    if whole:
        measured["whole_model"] = whole
    else:
        measured.pop("whole_model", None)  # a re-profile's table is not the old factors' any more
    if kernels is not None:
        measured.update({k: kernels[k] for k in ("gemm", "memory_bandwidth", "attention") if k in kernels})
        if "attention" not in kernels:
            measured.pop("attention", None)  # a re-profile without it: not the old device's rates
        measured["fitted"] = {**measured.get("fitted", {}), **kernels["fitted"]}
    data["measured"] = measured
    notes = derived_spec(data, out.stem, info, measured, args.gpus_per_node)
    write_profile(out, data)
    for note in notes:
        log(note.replace("THIS_FILE", str(out)))
    print(f"profile written to {out} ({sum(len(v) for v in measured['layers'].values())} layer points, "
          f"device {info['name']}, {dtype}, {info['threads']} thread(s) per rank, {load_ranks} concurrent rank(s))")
    if device.type == "cpu" and not args.no_comm and load_ranks >= 2:
        from autopar.commands.profile_comm import launch_comm

        log(f"measuring the collectives on {load_ranks} ranks (--no-comm to skip)")
        code = launch_comm(out, load_ranks, repeats=args.repeats, device="cpu", gpus_per_node=args.gpus_per_node)
        if code:
            return code
    return 0


def _param_shapes(mf) -> list[tuple[int, ...]]:  # noqa: ANN001
    """The one-block model's parameter shapes (its edges and one block, on meta), what the
    optimizer figure is timed on (autopar.profiler.kernels). Called after the layer table, which
    has already cut the model the same way."""
    from autopar.profiler.layers import one_block_meta

    return [tuple(p.shape) for p in one_block_meta(mf).parameters() if p.requires_grad]
