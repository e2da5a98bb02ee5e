"""Megatron-LM / NeMo: a plan as ``pretrain_gpt.py`` command-line flags, and those flags read back.

The flag names, which take a value and which choices they allow are Megatron-LM's own, read from its
``megatron/training/arguments.py`` at the commit named in ``megatron_lm_arguments.json`` (the
training scripts are not in an installable package; megatron-core holds the configs the flags fill).
Reading parses the user's file with an argparse built from that table, as Megatron-LM would: a
file may be the bare flags (one or more per line, ``\\`` continuations, ``#`` comments) or a whole
launch line (``torchrun --nproc-per-node 8 --nnodes 8 pretrain_gpt.py --flags``, whose GPU count is
then read too).

Mapping (autopar -> Megatron-LM):
  tp, pp, cp, ep        --tensor-model-parallel-size, --pipeline-model-parallel-size,
                        --context-parallel-size, --expert-model-parallel-size (dp is what is left)
  cp kind               --cp-comm-type p2p (ring) | allgather | a2a (Ulysses)
  sequence parallel     --sequence-parallel
  interleaved 1F1B      --num-virtual-stages-per-pipeline-rank V
  uneven stage split    --pipeline-model-parallel-layout "Et*3|t*4|...|t*3L" (E embedding, t a block, L loss)
  zero 1 / 2 / 3        --use-distributed-optimizer / --use-megatron-fsdp --data-parallel-sharding-strategy
                        optim_grads / optim_grads_params
  recompute selective   --recompute-activations (Megatron's selective = the attention core, as autopar's)
  recompute full        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  per-stage full counts --recompute-granularity full --recompute-method block --recompute-num-layers N
  optimizer offload     --optimizer-cpu-offload --use-precision-aware-optimizer (with zero 1)
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
from pathlib import Path
from typing import Any

from autopar.engines.capability import block_recompute_layers
from autopar.engines.config import EngineConfig, header_line, read_header, split_launch
from autopar.errors import AutoparError
from autopar.plan import Plan

ARGUMENTS_FILE = Path(__file__).with_name("megatron_lm_arguments.json")
CP_COMM = {"ring": "p2p", "allgather": "allgather", "ulysses": "a2a"}
_CP_KIND = {"p2p": "ring", "allgather": "allgather", "all_gather": "allgather", "a2a": "ulysses"}
_SHARDING_ZERO = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
DTYPE_FLAG = {"bf16": "--bf16", "fp16": "--fp16"}
# Flags autopar reads (the rest of a file is listed to the user as not read).
READ_FLAGS = frozenset({
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--cp-comm-type", "--sequence-parallel", "--num-virtual-stages-per-pipeline-rank",
    "--num-layers-per-virtual-pipeline-stage", "--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--use-distributed-optimizer", "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy", "--use-torch-fsdp2", "--recompute-activations", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--recompute-modules", "--optimizer-cpu-offload",
    "--use-precision-aware-optimizer", "--micro-batch-size", "--global-batch-size", "--seq-length", "--bf16",
    "--fp16", "--optimizer", "--num-layers", "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
    "--grad-reduce-in-bf16", "--main-grads-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype", "--main-params-dtype",
    "--num-attention-heads", "--group-query-attention", "--num-query-groups"})


@functools.lru_cache(maxsize=1)
def megatron_flags() -> dict[str, Any]:
    """Megatron-LM's options (``megatron_lm_arguments.json``): flag -> {flag, nargs, type, choices}."""
    return json.loads(ARGUMENTS_FILE.read_text())["flags"]


def megatron_source() -> str:
    """Which Megatron-LM the flag table was read from (repository, file, commit)."""
    return json.loads(ARGUMENTS_FILE.read_text())["source"]


def export_megatron(plan: Plan, *, plan_name: str, cluster: Any = None) -> str:
    """The plan as Megatron-LM flags, one per line, with a comment header (what it is, and the GPU
    count and cluster autopar priced, which ``estimate --from megatron`` reads back). ``cluster``
    (the plan's priced profile) adds the software flags it prices (``software_flags``)."""
    par, tr = plan.parallel, plan.training
    lines = [f"# Megatron-LM flags for {plan_name}: {plan.cluster.num_gpus} GPUs, dp {par.dp} x tp {par.tp} x "
             f"pp {par.pp} x cp {par.cp} (autopar export --to megatron)",
             "# Add your model's architecture flags (--hidden-size, --num-attention-heads, ...) and data flags;",
             "# launch on the GPU count below: torchrun --nproc-per-node G --nnodes N pretrain_gpt.py $(grep -v '^#' FILE)",
             f"# {header_line(plan)}",
             f"--num-layers {plan.model.num_blocks}",
             f"--seq-length {tr.seq_len}",
             f"--micro-batch-size {tr.micro_batch_size}",
             f"--global-batch-size {tr.global_batch_size}",
             f"--tensor-model-parallel-size {par.tp}",
             f"--pipeline-model-parallel-size {par.pp}",
             f"--context-parallel-size {par.cp}"]
    if par.sequence_parallel and par.tp > 1:
        lines.append("--sequence-parallel")
    if par.cp > 1:
        lines.append(f"--cp-comm-type {CP_COMM[par.cp_kind]}")
    if par.ep > 1:
        lines.append(f"--expert-model-parallel-size {par.ep}")
    if par.pp > 1:
        lines += _pipeline_flags(plan)
    if par.zero == 1:
        lines.append("--use-distributed-optimizer")
    elif par.zero >= 2:
        lines += ["--use-megatron-fsdp",
                  f"--data-parallel-sharding-strategy {'optim_grads' if par.zero == 2 else 'optim_grads_params'}"]
    lines += _recompute_flags(plan)
    if par.offload.optimizer:
        lines += ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
    if tr.dtype in DTYPE_FLAG:
        lines.append(DTYPE_FLAG[tr.dtype])
    lines.append(f"--optimizer {'sgd' if tr.optimizer == 'sgd' else 'adam'}")
    if cluster is not None:
        lines += software_flags(plan, cluster)
    return "\n".join(lines) + "\n"


def software_flags(plan: Plan, cluster: Any) -> list[str]:
    """The Megatron-LM flags of the software switches ``cluster`` prices (autopar.cluster.Cluster:
    overlap_grad_reduce, overlap_param_gather, tp_comm_overlap; on a Megatron profile also its
    gradient-buffer and optimizer-state precisions), where the plan uses them."""
    par = plan.parallel
    out = []
    if cluster.overlap_grad_reduce and par.dp > 1:
        out.append("--overlap-grad-reduce")
    if cluster.overlap_param_gather and par.dp > 1 and par.zero >= 1:  # Megatron: distributed optimizer only
        out.append("--overlap-param-gather")
    if cluster.tp_comm_overlap and par.tp > 1 and par.sequence_parallel:  # Megatron: needs sequence parallelism
        out.append("--tp-comm-overlap")
    if cluster.main_grad_bytes:
        if cluster.main_grad_bytes == 2:
            out.append("--grad-reduce-in-bf16")
        if cluster.optimizer_moment_bytes == 2:
            out += ["--use-precision-aware-optimizer", "--exp-avg-dtype bf16", "--exp-avg-sq-dtype bf16"]
        if cluster.master_weight_bytes is not None:
            if cluster.master_weight_bytes != 2:
                raise AutoparError(f"{cluster.name} prices a master copy of {cluster.master_weight_bytes:g} bytes per "
                                   f"parameter, which no Megatron-LM flag sets; export from a plan on a stock profile")
            out += ["--use-precision-aware-optimizer", "--main-params-dtype fp16"]
    return list(dict.fromkeys(out))


def _software(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """The Cluster fields Megatron-LM's software flags set, as the flags say (absent = Megatron's
    default: no overlap, fp32 main gradients with 16-bit training, fp32 optimizer states)."""
    bf16_grads = args.grad_reduce_in_bf16 or args.main_grads_dtype == "bf16"
    moments = 2.0 if args.use_precision_aware_optimizer and args.exp_avg_dtype == "bf16" \
        and args.exp_avg_sq_dtype == "bf16" else 4.0
    master = 2.0 if args.use_precision_aware_optimizer and args.main_params_dtype == "fp16" else None
    return (("overlap_grad_reduce", bool(args.overlap_grad_reduce)),
            ("overlap_param_gather", bool(args.overlap_param_gather)),
            ("tp_comm_overlap", bool(args.tp_comm_overlap)),
            ("main_grad_bytes", 2.0 if bf16_grads else 4.0),
            ("optimizer_moment_bytes", moments), ("master_weight_bytes", master))


def _pipeline_flags(plan: Plan) -> list[str]:
    par = plan.parallel
    ranges = plan.stage_ranges()
    sizes = [end - start for start, end in ranges]
    if len(set(sizes)) == 1:  # Megatron's own even split
        return ([f"--num-virtual-stages-per-pipeline-rank {par.pp_virtual_stages}"]
                if par.pp_virtual_stages > 1 else [])
    return [f"--pipeline-model-parallel-layout {shlex.quote(layout_string(sizes))}"]


def layout_string(sizes: list[int]) -> str:
    """Blocks per stage as megatron-core's layout string: E (embedding) on the first stage, L (loss) on
    the last, and runs of equal middle stages as ``(t*n|)*k`` ("Et*3|(t*3|)*15(t*4|)*6t*4L")."""
    def stage(n: int) -> str:
        return f"t*{n}" if n > 1 else "t"

    if len(sizes) == 1:
        return f"E{stage(sizes[0])}L"
    out, middle, c = [f"E{stage(sizes[0])}|"], sizes[1:-1], 0
    while c < len(middle):
        run = 1
        while c + run < len(middle) and middle[c + run] == middle[c]:
            run += 1
        out.append(f"({stage(middle[c])}|)*{run}" if run > 1 else f"{stage(middle[c])}|")
        c += run
    return "".join(out) + f"{stage(sizes[-1])}L"


def _recompute_flags(plan: Plan) -> list[str]:
    par = plan.parallel
    if par.recompute_blocks is not None:
        n = block_recompute_layers(plan)
        if n is None:  # capability.plan_reason refuses these before export
            raise AutoparError("this per-stage recompute mix has no Megatron-LM equivalent")
        return ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {n}"]
    if par.recompute == "selective":
        return ["--recompute-activations"]
    if par.recompute == "full":
        return ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    return []


# --------------------------------------------------------------------------------------------- reading

def _tokens(text: str) -> tuple[list[str], int | None]:
    """The Megatron flags of a file (bare flags or a launch line) and the GPU count a torchrun
    prefix gives, if any."""
    joined = re.sub(r"\\\r?\n", " ", text)
    try:
        tokens = shlex.split(joined, comments=True)
    except ValueError as exc:
        raise AutoparError(f"cannot read the flags: {exc}; give Megatron-LM flags as a shell would") from None
    return split_launch(tokens)


class _Refuse(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise AutoparError(f"not valid Megatron-LM flags: {message}")


def _parser() -> argparse.ArgumentParser:
    """An argparse with every Megatron-LM option, as Megatron-LM declares it (no abbreviations)."""
    p = _Refuse(prog="Megatron-LM", add_help=False, allow_abbrev=False)
    for flag, spec in megatron_flags().items():
        if spec.get("flag") or spec.get("nargs") == 0:
            p.add_argument(flag, action="store_true")
        else:
            kind = {"int": int, "float": float}.get(spec.get("type", ""), str)
            p.add_argument(flag, type=kind, nargs=spec.get("nargs"), choices=spec.get("choices"))
    return p


def read_megatron(text: str, *, source: str) -> EngineConfig:
    """The configuration Megatron-LM flags run (``EngineConfig``), as Megatron-LM's parser reads them.
    A flag Megatron-LM does not have, or a value it would refuse, is one line naming it."""
    flags, launch_gpus = _tokens(text)
    args, unknown = _parser().parse_known_args(flags)
    if unknown:
        raise AutoparError(f"{source}: {unknown[0]} is not a Megatron-LM flag (Megatron-LM at "
                           f"{megatron_source().split(' at ')[-1]}); remove it or check its spelling")
    given = [t.split("=")[0] for t in flags if t.startswith("--")]
    ignored = tuple(dict.fromkeys(f for f in given if f not in READ_FLAGS))
    header = read_header(text)
    num_layers = args.num_layers
    pp, tp, cp = args.pipeline_model_parallel_size or 1, args.tensor_model_parallel_size or 1, \
        args.context_parallel_size or 1
    chunk_layers, v = _stages(args, pp, num_layers, source)
    cfg = EngineConfig(
        engine="megatron", source=source, tp=tp, pp=pp, cp=cp, cp_kind=_cp_kind(args.cp_comm_type, source),
        sequence_parallel=bool(args.sequence_parallel), zero=_zero(args), pp_schedule="interleaved-1f1b" if v > 1
        else "1f1b", pp_virtual_stages=v, chunk_layers=chunk_layers, ep=args.expert_model_parallel_size or 1,
        offload="optimizer" if args.optimizer_cpu_offload else "none", micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size, seq_len=args.seq_length,
        dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        optimizer="sgd" if args.optimizer == "sgd" else "adam", num_gpus=launch_gpus or header.get("gpus"),
        gpus_per_node=header.get("gpus-per-node"), num_layers=num_layers, num_heads=args.num_attention_heads,
        num_kv_heads=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        cluster=header.get("cluster"),
        ignored=ignored, software=_software(args),
        **_recompute(args, source))
    if cfg.global_batch_size is None and cfg.num_gpus is not None:  # Megatron's default: one micro-batch per dp rank
        cfg = cfg.with_overrides(global_batch_size=(cfg.micro_batch_size or 1) * cfg.num_gpus // (tp * pp * cp))
    return cfg


def _cp_kind(comm: list[str] | None, source: str) -> str:
    kinds = set(comm or ["p2p"])
    if len(kinds) > 1:
        raise AutoparError(f"{source}: --cp-comm-type differs between layers ({' '.join(comm or [])}); "
                           f"autopar prices one kind for every layer")
    kind = kinds.pop()
    if kind not in _CP_KIND:
        raise AutoparError(f"{source}: --cp-comm-type {kind} is not modelled; use p2p, allgather or a2a")
    return _CP_KIND[kind]


def _zero(args: argparse.Namespace) -> int:
    if args.use_megatron_fsdp:
        return _SHARDING_ZERO[args.data_parallel_sharding_strategy or "optim_grads_params"]
    if args.use_torch_fsdp2:
        return 3
    return 1 if args.use_distributed_optimizer else 0


def _recompute(args: argparse.Namespace, source: str) -> dict[str, Any]:
    granularity = "selective" if args.recompute_activations else args.recompute_granularity
    if granularity is None:
        return {"recompute": "none"}
    if granularity == "selective":
        modules = args.recompute_modules or ["core_attn"]
        if modules != ["core_attn"]:
            raise AutoparError(f"{source}: selective recompute of {' '.join(modules)} is not modelled; autopar "
                               f"prices Megatron's default selective recompute (--recompute-modules core_attn)")
        return {"recompute": "selective"}
    method, n = args.recompute_method, args.recompute_num_layers
    if method is None or n is None:
        raise AutoparError(f"{source}: --recompute-granularity full needs --recompute-method and "
                           f"--recompute-num-layers (as Megatron-LM requires)")
    if method == "block":
        return {"recompute": "none", "recompute_full_per_chunk": n}
    if n != 1:
        raise AutoparError(f"{source}: --recompute-method uniform --recompute-num-layers {n} (checkpoints of {n} "
                           f"layers) is not modelled; use --recompute-num-layers 1")
    return {"recompute": "full"}


def _stages(args: argparse.Namespace, pp: int, num_layers: int | None, source: str) -> tuple[tuple[int, ...] | None, int]:
    """Blocks per model chunk (None: Megatron's even split) and the virtual stages per rank."""
    if pp == 1:
        return None, 1
    if args.pipeline_model_parallel_layout:
        chunks = _parse_layout(args.pipeline_model_parallel_layout, source)
        if len(chunks) % pp:
            raise AutoparError(f"{source}: --pipeline-model-parallel-layout has {len(chunks)} stages, not a multiple "
                               f"of pp {pp}")
        return tuple(chunks), len(chunks) // pp
    v = args.num_virtual_stages_per_pipeline_rank or 1
    if args.num_layers_per_virtual_pipeline_stage:
        if num_layers is None:
            raise AutoparError(f"{source}: --num-layers-per-virtual-pipeline-stage needs --num-layers")
        v = num_layers // (pp * args.num_layers_per_virtual_pipeline_stage)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is None and last is None:
        if num_layers is not None and num_layers % (pp * v):
            raise AutoparError(f"{source}: {num_layers} layers do not divide into pp {pp} x {v} virtual stages "
                               f"(Megatron-LM requires it); give --decoder-first/last-pipeline-num-layers or a layout")
        return None, v
    if num_layers is None:
        raise AutoparError(f"{source}: --decoder-first/last-pipeline-num-layers need --num-layers")
    if v > 1:
        raise AutoparError(f"{source}: uneven first/last stages with virtual stages are not modelled; "
                           f"give --pipeline-model-parallel-layout")
    middle = num_layers - (first or 0) - (last or 0)
    inner = pp - (first is not None) - (last is not None)
    if inner < 0 or (inner and middle % inner) or (not inner and middle):
        raise AutoparError(f"{source}: the layers left after the first/last stages do not divide evenly "
                           f"(Megatron-LM requires it)")
    per = middle // inner if inner else 0
    sizes = ([first] if first is not None else []) + [per] * inner + ([last] if last is not None else [])
    return tuple(sizes), 1


def _parse_layout(layout: str, source: str) -> list[int]:
    """Blocks per stage of a Megatron layout string ("Et*3|(tt|)*29,m|L", megatron-core's grammar)."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    bad = set("".join(stages)) - set("EtL")
    if bad:
        raise AutoparError(f"{source}: the pipeline layout has {''.join(sorted(bad))} layers, which autopar does not "
                           f"model (only E, t and L)")
    return [s.count("t") for s in stages]

