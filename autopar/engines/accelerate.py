"""Hugging Face accelerate: a plan as an ``accelerate launch --config_file`` YAML, and one read back.

Keys as accelerate 1.16 names them (``commands/config/config_args.py`` ClusterConfig, the FSDP keys
of ``commands/launch.py``, ``parallelism_config.py``): FSDP2 (``fsdp_version: 2``) with
``fsdp_reshard_after_forward`` true (ZeRO-3) or false (ZeRO-2), ``fsdp_offload_params``,
``fsdp_activation_checkpointing``; ``parallelism_config`` for tp and cp (accelerate runs those on
FSDP2 only). ZeRO-0 is ``distributed_type: MULTI_GPU`` (DDP). accelerate's config holds no batch
size (the training script sets it): the export writes the batch in an ``autopar:`` comment, and
``estimate --from accelerate`` reads it from there or from --micro-batch / --global-batch.
"""

from __future__ import annotations

from typing import Any

import yaml

from autopar.engines.config import EngineConfig, header_line, read_header
from autopar.errors import AutoparError
from autopar.plan import Plan

READ_KEYS = {"distributed_type", "num_processes", "num_machines", "mixed_precision", "fsdp_config",
             "parallelism_config", "compute_environment", "machine_rank", "main_training_function", "use_cpu",
             "rdzv_backend", "same_network", "main_process_ip", "main_process_port", "tpu_env", "tpu_use_cluster",
             "tpu_use_sudo", "downcast_bf16", "debug", "enable_cpu_affinity", "gpu_ids"}
_FSDP_READ = {"fsdp_version", "fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_activation_checkpointing",
              "fsdp_auto_wrap_policy", "fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading",
              "fsdp_transformer_layer_cls_to_wrap"}
_PC = "parallelism_config_"


def config_of(plan: Plan) -> dict[str, Any]:
    """The plan as an accelerate config dict."""
    par, tr = plan.parallel, plan.training
    fsdp = par.zero >= 2
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP" if fsdp else "MULTI_GPU",
        "mixed_precision": {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[tr.dtype],
        "num_machines": plan.cluster.num_nodes,
        "num_processes": plan.cluster.num_gpus,
        "machine_rank": 0,
        "main_training_function": "main",
        "use_cpu": False,
    }
    if fsdp:
        out["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": par.zero == 3, "fsdp_offload_params": par.offload.params,
            "fsdp_activation_checkpointing": par.recompute == "full", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True}
        out["parallelism_config"] = {f"{_PC}dp_replicate_size": 1, f"{_PC}dp_shard_size": par.dp,
                                     f"{_PC}tp_size": par.tp, f"{_PC}cp_size": par.cp}
    return out


def export_accelerate(plan: Plan, *, plan_name: str) -> str:
    """The plan as an accelerate config YAML, the batch and the GPU count in comment lines."""
    par, tr = plan.parallel, plan.training
    accumulation = tr.global_batch_size // (tr.micro_batch_size * par.dp)
    head = [f"# accelerate config for {plan_name}: {plan.cluster.num_gpus} GPUs, dp {par.dp} x tp {par.tp} x "
            f"cp {par.cp} (autopar export --to accelerate); accelerate launch --config_file THIS_FILE train.py",
            f"# In your script: per-device batch {tr.micro_batch_size}, gradient accumulation {accumulation} "
            f"(Accelerator(gradient_accumulation_steps={accumulation}) or TrainingArguments), sequence {tr.seq_len}"
            + ("; gradient checkpointing on (model.gradient_checkpointing_enable())"
               if par.recompute == "full" and par.zero < 2 else ""),
            f"# {header_line(plan)} micro-batch {tr.micro_batch_size} global-batch {tr.global_batch_size} "
            f"seq-len {tr.seq_len} recompute {par.recompute}"]
    return "\n".join(head) + "\n" + yaml.safe_dump(config_of(plan), sort_keys=False)


def read_accelerate(text: str, *, source: str) -> EngineConfig:
    """The configuration an accelerate config YAML runs, as ``EngineConfig``."""
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AutoparError(f"{source} is not an accelerate config YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(cfg, dict) or "distributed_type" not in cfg:
        raise AutoparError(f"{source} is not an accelerate config: it has no distributed_type; give the file of "
                           f"'accelerate launch --config_file'")
    kind = cfg["distributed_type"]
    if kind not in ("FSDP", "MULTI_GPU", "NO"):
        raise AutoparError(f"{source}: distributed_type {kind} is not modelled here; use FSDP or MULTI_GPU "
                           f"(or export --to deepspeed for DeepSpeed)")
    ignored = [k for k in cfg if k not in READ_KEYS]
    fsdp = cfg.get("fsdp_config") or {}
    ignored += [k for k in fsdp if k not in _FSDP_READ]
    pc = {k.removeprefix(_PC): v for k, v in (cfg.get("parallelism_config") or {}).items()}
    zero, recompute, offload = 0, "none", "none"
    if kind == "FSDP":
        if int(fsdp.get("fsdp_version", 1)) != 2:
            raise AutoparError(f"{source}: FSDP version 1 is not modelled; set fsdp_version: 2")
        zero = 3 if _true(fsdp.get("fsdp_reshard_after_forward", True)) else 2
        recompute = "full" if _true(fsdp.get("fsdp_activation_checkpointing", False)) else "none"
        offload = "params" if _true(fsdp.get("fsdp_offload_params", False)) else "none"
    replicate, shard = int(pc.get("dp_replicate_size", 1) or 1), int(pc.get("dp_shard_size", 0) or 0)
    if replicate > 1 and shard > 1:
        raise AutoparError(f"{source}: replicate x shard (HSDP) is not modelled; set dp_replicate_size 1")
    header = read_header(text)
    if kind != "FSDP" and header.get("recompute") in ("none", "full"):  # DDP: the script's gradient checkpointing
        recompute = header["recompute"]
    return EngineConfig(
        engine="accelerate", source=source, dp=(shard or None) if kind == "FSDP" else None,
        tp=int(pc.get("tp_size", 1) or 1), cp=int(pc.get("cp_size", 1) or 1), cp_kind="allgather", zero=zero,
        recompute=recompute, offload=offload,
        micro_batch_size=_int(header.get("micro-batch")), global_batch_size=_int(header.get("global-batch")),
        seq_len=_int(header.get("seq-len")),
        dtype={"bf16": "bf16", "fp16": "fp16", "no": "fp32"}.get(str(cfg.get("mixed_precision", "no")), "fp32"),
        num_gpus=_int(cfg.get("num_processes")),
        gpus_per_node=header.get("gpus-per-node"), cluster=header.get("cluster"), ignored=tuple(ignored))


def _true(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def _int(value: Any) -> int | None:
    return int(value) if value is not None and str(value).isdigit() else None
