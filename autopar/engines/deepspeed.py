"""DeepSpeed: a plan as a DeepSpeed config JSON, and a DeepSpeed config read back.

Keys as DeepSpeed 0.19 defines them (``runtime/config.py``, ``runtime/zero/config.py``,
``runtime/zero/offload_config.py``, ``runtime/tensor_parallel/config.py``). DeepSpeed's batch rule,
checked by its own ``DeepSpeedConfig``: train_batch_size = train_micro_batch_size_per_gpu x
gradient_accumulation_steps x the data-parallel world size.

Mapping (autopar -> DeepSpeed):
  dp, zero            the data-parallel world (train_batch_size / micro / accumulation),
                      zero_optimization.stage
  tp                  tensor_parallel.autotp_size (AutoTP training; no sequence parallelism)
  optimizer offload   zero_optimization.offload_optimizer.device = cpu (ZeRO-Offload)
  params offload      zero_optimization.offload_param.device = cpu (ZeRO-3)
  recompute full      activation_checkpointing (its checkpointing API, or the model's
                      gradient_checkpointing_enable(), recomputes each block)
  dtype               bf16.enabled / fp16.enabled
Pipeline parallelism is DeepSpeed's PipelineModule in the model code, not a config key, so a plan with
pp > 1 is not exported here (``plan --engine deepspeed`` plans without it).
"""

from __future__ import annotations

import json
from typing import Any

from autopar.engines.config import EngineConfig
from autopar.errors import AutoparError
from autopar.plan import Plan

_OPTIMIZER = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
READ_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "fp16",
             "zero_optimization", "tensor_parallel", "activation_checkpointing", "optimizer"}
_ZERO_KEYS = {"stage", "offload_optimizer", "offload_param"}


def config_of(plan: Plan) -> dict[str, Any]:
    """The plan as a DeepSpeed config dict."""
    par, tr = plan.parallel, plan.training
    zero: dict[str, Any] = {"stage": par.zero}
    if par.offload.optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if par.offload.params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    out: dict[str, Any] = {
        "train_batch_size": tr.global_batch_size,
        "train_micro_batch_size_per_gpu": tr.micro_batch_size,
        "gradient_accumulation_steps": tr.global_batch_size // (tr.micro_batch_size * par.dp),
        "bf16": {"enabled": tr.dtype == "bf16"},
        "fp16": {"enabled": tr.dtype == "fp16"},
        "zero_optimization": zero,
    }
    if par.tp > 1:
        out["tensor_parallel"] = {"autotp_size": par.tp}
    if par.recompute == "full":
        out["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False}
    out["optimizer"] = {"type": _OPTIMIZER[tr.optimizer]}
    return out


def export_deepspeed(plan: Plan, *, plan_name: str) -> str:
    """The plan as DeepSpeed config JSON (JSON has no comments: the GPU count follows from the batch
    keys, the cluster is given again to ``estimate --from deepspeed --cluster``)."""
    return json.dumps(config_of(plan), indent=2) + "\n"


def read_deepspeed(text: str, *, source: str) -> EngineConfig:
    """The configuration a DeepSpeed config JSON runs, as ``EngineConfig``."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AutoparError(f"{source} is not a DeepSpeed config JSON ({exc.msg} at line {exc.lineno}); give the "
                           f"JSON you pass to deepspeed.initialize") from None
    if not isinstance(cfg, dict):
        raise AutoparError(f"{source} is not a DeepSpeed config: expected a JSON object")
    ignored = [k for k in cfg if k not in READ_KEYS]
    zero_cfg = cfg.get("zero_optimization") or {}
    ignored += [f"zero_optimization.{k}" for k in zero_cfg if k not in _ZERO_KEYS]
    stage = int(zero_cfg.get("stage", 0))
    if stage not in (0, 1, 2, 3):
        raise AutoparError(f"{source}: zero_optimization.stage must be 0-3, got {stage}")
    off_opt = (zero_cfg.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    off_par = (zero_cfg.get("offload_param") or {}).get("device", "none") not in ("none", None)
    if (off_opt or off_par) and any((zero_cfg.get(k) or {}).get("device") == "nvme"
                                    for k in ("offload_optimizer", "offload_param")):
        raise AutoparError(f"{source}: NVMe offload (ZeRO-Infinity) is not modelled; offload to cpu or not at all")
    offload = "params" if off_par else "optimizer" if off_opt else "none"
    if off_par and not off_opt:
        raise AutoparError(f"{source}: offload_param without offload_optimizer is not modelled; offload both "
                           f"(parameters on the host step there)")
    gbs, mbs, gas = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps"))
    dp = None
    if gbs is not None and mbs is not None:
        gas = gas or 1
        if gbs % (mbs * gas):
            raise AutoparError(f"{source}: train_batch_size {gbs} is not train_micro_batch_size_per_gpu {mbs} x "
                               f"gradient_accumulation_steps {gas} x a data-parallel world (DeepSpeed refuses it)")
        dp = gbs // (mbs * gas)
    elif gbs is None:
        raise AutoparError(f"{source}: give train_batch_size and train_micro_batch_size_per_gpu")
    tp = int((cfg.get("tensor_parallel") or {}).get("autotp_size", 0) or 1)
    dtype = "bf16" if (cfg.get("bf16") or {}).get("enabled") else "fp16" if (cfg.get("fp16") or {}).get(
        "enabled") else "fp32"
    optimizer = str((cfg.get("optimizer") or {}).get("type", "Adam")).lower()
    if optimizer not in _OPTIMIZER:
        raise AutoparError(f"{source}: optimizer {optimizer} is not modelled; use Adam, AdamW or SGD")
    return EngineConfig(engine="deepspeed", source=source, dp=dp, tp=tp, zero=stage,
                        recompute="full" if "activation_checkpointing" in cfg else "none", offload=offload,
                        micro_batch_size=mbs, global_batch_size=gbs, dtype=dtype, optimizer=optimizer,
                        ignored=tuple(ignored))
