"""An export checked by the engine's own code, where that engine is installed (``export --check``).

Each check hands the exported settings to the parser or config class the engine itself uses and
compares what it reads back with the plan's degrees and batch; the engine's refusal, or a disagreement,
is one line. The engines are optional: without one installed the check says so and passes nothing.

  megatron    megatron-core's ``TransformerConfig`` (degrees, virtual stages, the pipeline layout string,
              sequence parallelism, recompute), after Megatron-LM's own argument table parsed the flags
  torchtitan  tyro over torchtitan's ``TrainingConfig`` / ``ParallelismConfig`` / activation-checkpoint
              configs with torchtitan's tyro rules (what its ConfigManager does), then ``ParallelDims``
  deepspeed   ``DeepSpeedConfig`` at the plan's data-parallel world (its batch-size rule)
  accelerate  ``load_config_from_file`` and ``ParallelismConfig``
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import tempfile
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.plan import Plan

PACKAGES = {"megatron": "megatron-core", "torchtitan": "torchtitan", "deepspeed": "deepspeed",
            "accelerate": "accelerate"}


def installed_version(engine: str) -> str | None:
    """The installed version of ``engine``'s package, or None."""
    try:
        return importlib.metadata.version(PACKAGES[engine])
    except importlib.metadata.PackageNotFoundError:
        return None


def check_export(plan: Plan, engine: str, text: str) -> str | None:
    """Check ``text`` (``plan`` exported for ``engine``) with the engine's own code: a one-line
    description of what accepted it, None when the engine is not installed; an AutoparError when
    the engine refuses it or reads other degrees than the plan's."""
    version = installed_version(engine)
    if version is None:
        return None
    try:
        {"megatron": _megatron, "torchtitan": _torchtitan, "deepspeed": _deepspeed,
         "accelerate": _accelerate}[engine](plan, text)
    except AutoparError:
        raise
    except (Exception, SystemExit) as exc:  # the engine's own refusal, whatever it raises
        raise AutoparError(f"{PACKAGES[engine]} {version} refuses the export: {type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:300]}") from None
    return f"checked with {PACKAGES[engine]} {version}"


def _expect(what: str, got: Any, want: Any) -> None:
    if got != want:
        raise AutoparError(f"the engine reads {what} {got}, the plan has {want}")


def _megatron(plan: Plan, text: str) -> None:
    import warnings

    import torch

    from autopar.engines.megatron import read_megatron

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer import TransformerConfig

    cfg = read_megatron(text, source="export")
    par = plan.parallel
    layout = next((ln.split(None, 1)[1].strip("'") for ln in text.splitlines()
                   if ln.startswith("--pipeline-model-parallel-layout")), None)
    full = cfg.recompute == "full" or cfg.recompute_full_per_chunk is not None
    heads = 8 * par.tp * max(1, par.cp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = TransformerConfig(
            num_layers=plan.model.num_blocks, hidden_size=64 * heads, num_attention_heads=heads,
            tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
            virtual_pipeline_model_parallel_size=cfg.pp_virtual_stages if cfg.pp_virtual_stages > 1 and not layout
            else None, pipeline_model_parallel_layout=layout, context_parallel_size=cfg.cp,
            expert_model_parallel_size=cfg.ep, num_moe_experts=8 * cfg.ep if cfg.ep > 1 else None,
            add_bias_linear=cfg.ep == 1, sequence_parallel=cfg.sequence_parallel and cfg.tp > 1,
            bf16=cfg.dtype == "bf16", fp16=cfg.dtype == "fp16", pipeline_dtype=torch.bfloat16,
            recompute_granularity="full" if full else "selective" if cfg.recompute == "selective" else None,
            recompute_method=("block" if cfg.recompute_full_per_chunk else "uniform") if full else None,
            recompute_num_layers=(cfg.recompute_full_per_chunk or 1) if full else None)
    _expect("tp x pp x cp", (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size, tc.context_parallel_size),
            (par.tp, par.pp, par.cp))
    v = tc.virtual_pipeline_model_parallel_size or 1
    _expect("virtual stages", v, par.pp_virtual_stages)


def _torchtitan(plan: Plan, text: str) -> None:
    import tyro
    from torchtitan.config.configs import ParallelismConfig, TrainingConfig
    from torchtitan.config.manager import ConfigManager, custom_registry
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, SelectiveAC
    from torchtitan.distributed.parallel_dims import ParallelDims

    from autopar.engines.torchtitan import overrides, parse_file

    sections = dataclasses.make_dataclass("Sections", [  # the Trainer.Config fields autopar writes
        ("training", TrainingConfig, dataclasses.field(default_factory=TrainingConfig)),
        ("parallelism", ParallelismConfig, dataclasses.field(default_factory=ParallelismConfig)),
        ("activation_checkpoint", ActivationCheckpointingConfig, dataclasses.field(default_factory=SelectiveAC.Config))])
    ConfigManager.register_tyro_rules(custom_registry)
    parsed = tyro.cli(sections, args=overrides(parse_file(text, "export")), registry=custom_registry)
    p, par = parsed.parallelism, plan.parallel
    dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, world_size=plan.cluster.num_gpus)
    _expect("dp x tp x pp x cp", (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp, dims.cp),
            (par.dp, par.tp, par.pp, par.cp))
    _expect("the global batch", parsed.training.global_batch_size, plan.training.global_batch_size)


def _deepspeed(plan: Plan, text: str) -> None:
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.runtime import config as ds_config

    dp = plan.parallel.dp

    class DataParallel:  # what DeepSpeed asks a model-parallel unit for: the data-parallel world
        def get_data_parallel_world_size(self) -> int:
            return dp

    get_rank = ds_config.dist.get_rank
    ds_config.dist.get_rank = lambda: 0  # no process group here: rank 0 of the plan's world
    try:
        cfg = ds_config.DeepSpeedConfig(json.loads(text), mpu=DataParallel())
    finally:
        ds_config.dist.get_rank = get_rank
    _expect("train_batch_size", cfg.train_batch_size, plan.training.global_batch_size)
    _expect("the micro-batch", cfg.train_micro_batch_size_per_gpu, plan.training.micro_batch_size)
    _expect("the ZeRO stage", cfg.zero_optimization_stage, plan.parallel.zero)


def _accelerate(plan: Plan, text: str) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.parallelism_config import ParallelismConfig

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "accelerate.yaml"
        path.write_text(text)
        cfg = load_config_from_file(str(path))
    _expect("num_processes", cfg.num_processes, plan.cluster.num_gpus)
    if cfg.parallelism_config:
        pc = ParallelismConfig(**{k.removeprefix("parallelism_config_"): v for k, v in cfg.parallelism_config.items()})
        _expect("dp x tp x cp", (pc.dp_shard_size * pc.dp_replicate_size, pc.tp_size, pc.cp_size),
                (plan.parallel.dp, plan.parallel.tp, plan.parallel.cp))
