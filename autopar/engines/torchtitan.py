"""torchtitan: a plan as torchtitan's configuration, and a torchtitan configuration read back.

The keys are torchtitan's own: each TOML section is a field of its ``Trainer.Config`` and each key a
field of that section's dataclass (``training``: TrainingConfig, ``parallelism``: ParallelismConfig,
in torchtitan 0.3's ``config/configs.py``); ``activation_checkpoint.mode`` is the policy torchtitan
0.3 selects by subcommand (``activation_checkpoint:full``) and 0.2 by this key. torchtitan <= 0.2 reads
the TOML itself (``--job.config_file``); torchtitan 0.3 takes the same settings as command-line
overrides, which the export prints in its header (``overrides``) and ``estimate --from torchtitan``
reads as well as the TOML.

Mapping (autopar -> torchtitan):
  dp, zero 0      data_parallel_replicate_degree = dp (DDP)
  dp, zero 2 / 3  data_parallel_shard_degree = dp, fsdp_reshard_after_forward = never / always (FSDP2)
  tp, sp          tensor_parallel_degree, enable_sequence_parallel
  pp              pipeline_parallel_degree, pipeline_parallel_schedule (GPipe, 1F1B, Interleaved1F1B),
                  pipeline_parallel_microbatch_size, module_fqns_per_model_part (the exact split, in
                  torchtitan's module names: tok_embeddings, layers.N, norm, lm_head)
  cp              context_parallel_degree (torch's context_parallel: KV all-gathered, autopar's allgather)
  ep              expert_parallel_degree
  recompute       activation_checkpoint mode none | full | selective (per-op, autopar's op)
  params offload  training.enable_cpu_offload (FSDP2 CPUOffloadPolicy)
  batch           training.local_batch_size (per dp rank and accumulation step; with pp the whole
                  pipelined batch), training.global_batch_size, training.seq_len
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from autopar.engines.config import EngineConfig, check_virtual_stages, header_line, read_header, split_launch
from autopar.errors import AutoparError
from autopar.plan import Plan

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}
_SCHEDULE = {v.lower(): k for k, v in SCHEDULES.items()}
_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}
_RECOMPUTE = {"none": "none", "full": "full", "op": "selective"}
# What autopar reads, per section (the rest is listed to the user as not read).
READ_KEYS = {
    "training": {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param", "enable_cpu_offload"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "enable_sequence_parallel", "pipeline_parallel_degree",
                    "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size", "module_fqns_per_model_part",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers", "context_parallel_degree", "expert_parallel_degree"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "optimizer": {"name"},
}
_OPTIMIZER = {"adam": "adam", "adamw": "adamw"}  # torchtitan's optimizer factories (Adam, AdamW)


def config_of(plan: Plan) -> dict[str, dict[str, Any]]:
    """The plan as torchtitan sections: {section: {key: value}}."""
    par, tr = plan.parallel, plan.training
    accumulation_rows = tr.micro_batch_size if par.pp == 1 else tr.global_batch_size // par.dp
    training = {"local_batch_size": accumulation_rows, "global_batch_size": tr.global_batch_size,
                "seq_len": tr.seq_len, "mixed_precision_param": _DTYPE[tr.dtype],
                "enable_cpu_offload": par.offload.params}
    shard = par.zero >= 2
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": 1 if shard else par.dp,
        "data_parallel_shard_degree": par.dp if shard else 1,
        "fsdp_reshard_after_forward": "never" if par.zero == 2 else "always",
        "tensor_parallel_degree": par.tp, "enable_sequence_parallel": bool(par.sequence_parallel),
        "pipeline_parallel_degree": par.pp, "context_parallel_degree": par.cp, "expert_parallel_degree": par.ep}
    if par.pp > 1:
        parallelism["pipeline_parallel_schedule"] = SCHEDULES[par.pp_schedule]
        parallelism["pipeline_parallel_microbatch_size"] = tr.micro_batch_size
        parallelism["module_fqns_per_model_part"] = module_fqns(plan)
    mode = _RECOMPUTE[par.recompute]
    checkpoint: dict[str, Any] = {"mode": mode}
    if mode == "selective":
        checkpoint["selective_ac_option"] = "op"
    return {"training": training, "parallelism": parallelism, "activation_checkpoint": checkpoint,
            "optimizer": {"name": {"adam": "Adam", "adamw": "AdamW"}[tr.optimizer]}}


def module_fqns(plan: Plan) -> list[list[str]]:
    """The plan's stage split in torchtitan's module names, one list per (virtual) stage."""
    ranges = plan.stage_ranges()
    parts = []
    for c, (start, end) in enumerate(ranges):
        names = [f"layers.{b}" for b in range(start, end)]
        if c == 0:
            names.insert(0, "tok_embeddings")
        if c == len(ranges) - 1:
            names += ["norm", "lm_head"]
        parts.append(names)
    return parts


def overrides(config: dict[str, dict[str, Any]]) -> list[str]:
    """The same settings as torchtitan 0.3 command-line overrides (``--section.key value``;
    the checkpoint policy as its subcommand ``activation_checkpoint:MODE``)."""
    out = []
    for section in ("training", "parallelism"):
        for key, value in config.get(section, {}).items():
            if key == "module_fqns_per_model_part":
                continue  # a list of lists has no command-line form in tyro: set it in your config function
            if isinstance(value, bool):  # tyro's flags: --section.key / --section.no_key
                out.append(f"--{section}.{'' if value else 'no_'}{key}")
            else:
                out += [f"--{section}.{key}", str(value)]
    mode = config.get("activation_checkpoint", {}).get("mode", "selective")
    out.append(f"activation_checkpoint:{mode}")
    return out



def export_torchtitan(plan: Plan, *, plan_name: str) -> str:
    """The plan as a torchtitan TOML, with the torchtitan 0.3 command line in its header."""
    config = config_of(plan)
    par = plan.parallel
    head = [f"# torchtitan configuration for {plan_name}: {plan.cluster.num_gpus} GPUs, dp {par.dp} x tp {par.tp} x "
            f"pp {par.pp} x cp {par.cp} (autopar export --to torchtitan)",
            "# torchtitan <= 0.2: --job.config_file THIS_FILE (add your [model] and data sections).",
            "# torchtitan 0.3: --module MODEL --config YOUR_CONFIG " + shlex.join(overrides(config))]
    if par.pp > 1:
        head.append("#   and parallelism.module_fqns_per_model_part below, set in your config function")
    head.append(f"# {header_line(plan)}")
    body = []
    for section, values in config.items():
        body.append(f"\n[{section}]")
        body += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(head + body) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


# --------------------------------------------------------------------------------------------- reading

def parse_file(text: str, source: str) -> dict[str, dict[str, Any]]:
    """A torchtitan TOML, or a file of torchtitan 0.3 command-line overrides, as {section: {key: value}}."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    if re.search(r"^\s*\[[\w.]+\]\s*$", body, re.MULTILINE) or re.search(r"^\s*\w+\s*=", body, re.MULTILINE):
        return _parse_toml(text, source)
    return _parse_overrides(text, source)


def _parse_toml(text: str, source: str) -> dict[str, dict[str, Any]]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise AutoparError("reading a TOML needs Python 3.11 or later (tomllib); give torchtitan 0.3 command-line "
                           "overrides instead") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AutoparError(f"{source} is not a valid TOML file: {exc}; give torchtitan's TOML or its "
                           f"command-line overrides") from None
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def _parse_overrides(text: str, source: str) -> dict[str, dict[str, Any]]:
    try:
        tokens = shlex.split(re.sub(r"\\\r?\n", " ", text), comments=True)
    except ValueError as exc:
        raise AutoparError(f"cannot read {source}: {exc}") from None
    tokens, gpus = split_launch(tokens, ("torchtitan.train",))
    out: dict[str, dict[str, Any]] = {"launch": {"gpus": gpus}} if gpus else {}
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.startswith("activation_checkpoint:"):
            out.setdefault("activation_checkpoint", {})["mode"] = t.split(":", 1)[1]
        elif t.startswith("--") and "." in t:
            key, eq, value = t[2:].partition("=")
            if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--") \
                    and not tokens[i + 1].startswith("activation_checkpoint:"):
                value, i = tokens[i + 1], i + 1
            section, _, name = key.partition(".")
            name = name.replace("-", "_")
            if not eq and value == "":  # a tyro flag: --section.key (true) or --section.no_key (false)
                flag = not name.startswith("no_")
                name, value = (name if flag else name[3:]), flag
            out.setdefault(section, {})[name] = _scalar(value)
        elif t.split("=")[0] in ("--module", "--config"):  # the model and its config function, not the layout
            if "=" not in t:
                i += 1
        else:
            raise AutoparError(f"{source}: cannot read {t!r}; give a torchtitan TOML or torchtitan 0.3 overrides "
                               f"(--section.key value)")
        i += 1
    return out


def _scalar(text: Any) -> Any:
    if isinstance(text, bool):
        return text
    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    try:
        return int(text)
    except ValueError:
        return text


def read_torchtitan(text: str, *, source: str) -> EngineConfig:
    """The configuration a torchtitan TOML (or 0.3 overrides) runs, as ``EngineConfig``."""
    cfg = parse_file(text, source)
    tr, par, ac = cfg.get("training", {}), cfg.get("parallelism", {}), cfg.get("activation_checkpoint", {})
    launch_gpus = cfg.pop("launch", {}).get("gpus")
    ignored = tuple(f"{s}.{k}" for s, values in cfg.items() for k in values if k not in READ_KEYS.get(s, ()))
    replicate, shard = int(par.get("data_parallel_replicate_degree", 1)), int(par.get("data_parallel_shard_degree", -1))
    tp, pp, cp = (int(par.get(k, 1)) for k in ("tensor_parallel_degree", "pipeline_parallel_degree",
                                                 "context_parallel_degree"))
    if replicate > 1 and shard != 1:
        raise AutoparError(f"{source}: replicate {replicate} x shard {shard} (HSDP) is not modelled; use one of "
                           f"data_parallel_replicate_degree and data_parallel_shard_degree")
    reshard = par.get("fsdp_reshard_after_forward", "default")
    zero = 0 if shard == 1 else (2 if reshard == "never" or (reshard == "default" and pp > 1) else 3)
    dp = replicate if shard == 1 else (shard if shard > 0 else None)
    schedule, v, chunk_layers, rule = _pipeline(par, pp, source)
    mode = ac.get("mode", "selective")
    if mode == "selective" and str(ac.get("selective_ac_option", "op")) != "op":
        raise AutoparError(f"{source}: selective_ac_option {ac['selective_ac_option']} (every Nth layer) is not "
                           f"modelled; use op, full or none")
    recompute = {"none": "none", "full": "full", "selective": "op"}.get(mode)
    if recompute is None:
        raise AutoparError(f"{source}: activation checkpointing {mode} is not modelled; use none, full or selective")
    local = tr.get("local_batch_size", 8)
    mbs = int(par.get("pipeline_parallel_microbatch_size", 1)) if pp > 1 else int(local)
    dtype = {v: k for k, v in _DTYPE.items()}.get(tr.get("mixed_precision_param", "bfloat16"))
    if dtype is None:
        raise AutoparError(f"{source}: mixed_precision_param {tr['mixed_precision_param']} is not bfloat16 or float32")
    optimizer = _OPTIMIZER.get(str(cfg.get("optimizer", {}).get("name", "AdamW")).lower())
    if optimizer is None:
        raise AutoparError(f"{source}: optimizer {cfg['optimizer']['name']} is not modelled; use Adam or AdamW")
    gbs = tr.get("global_batch_size", -1)
    header = read_header(text)
    return EngineConfig(
        engine="torchtitan", source=source, dp=dp, tp=tp, pp=pp, cp=cp, cp_kind="allgather",
        sequence_parallel=bool(par.get("enable_sequence_parallel", True)), zero=zero, recompute=recompute,
        pp_schedule=schedule, pp_virtual_stages=v, chunk_layers=chunk_layers, weighted_split=rule,
        ep=int(par.get("expert_parallel_degree", 1)),
        offload="params" if tr.get("enable_cpu_offload") else "none", micro_batch_size=mbs,
        global_batch_size=None if gbs in (-1, None) else int(gbs),
        local_batch_size=int(local), seq_len=tr.get("seq_len", 2048), dtype=dtype, optimizer=optimizer,
        num_gpus=(dp * tp * pp * cp if dp else None) or launch_gpus or header.get("gpus"),
        gpus_per_node=header.get("gpus-per-node"), cluster=header.get("cluster"), ignored=ignored)


def _pipeline(par: dict[str, Any], pp: int, source: str
              ) -> tuple[str, int, tuple[int, ...] | None, tuple[int | None, int, int, int | None] | None]:
    """(schedule, virtual stages, blocks per stage, torchtitan's weighted split rule): the blocks per
    stage where module_fqns_per_model_part names them; else the rule (stages or None, first-less,
    last-less, layers per stage or None), which ``to_plan`` resolves against the model's blocks (and
    the virtual stages with it). Neither for pp 1."""
    if pp == 1:
        return "1f1b", 1, None, None
    name = str(par.get("pipeline_parallel_schedule", "1F1B"))
    schedule = _SCHEDULE.get(name.lower())
    if schedule is None:
        raise AutoparError(f"{source}: pipeline schedule {name} is not modelled; use GPipe, 1F1B or Interleaved1F1B")
    fqns = par.get("module_fqns_per_model_part")
    if fqns:
        sizes = tuple(sum(1 for n in part if re.fullmatch(r"layers\.\d+", n)) for part in fqns)
        if len(sizes) % pp:
            raise AutoparError(f"{source}: module_fqns_per_model_part has {len(sizes)} parts, not a multiple of pp {pp}")
        check_virtual_stages(schedule, len(sizes) // pp, source)
        return schedule, len(sizes) // pp, sizes, None
    first, last = int(par.get("pipeline_parallel_first_stage_less_layers", 1)), \
        int(par.get("pipeline_parallel_last_stage_less_layers", 1))
    per_stage = par.get("pipeline_parallel_layers_per_stage")
    # torchtitan's default without layers per stage: one stage per rank, two for a looped schedule
    stages = None if per_stage is not None else pp * (2 if schedule == "interleaved-1f1b" else 1)
    return schedule, 1, None, (stages, first, last, per_stage)
