"""Plans for the engines users already run: Megatron-LM / NeMo, torchtitan, DeepSpeed, accelerate.

``capability`` states what each engine runs (``plan --engine`` searches only that);
``export_config`` writes a plan in the engine's own format (``autopar export --to``) and
``read_config`` reads a user's file back into autopar's terms (``autopar estimate --from``), so that
export then import gives back the same plan. One module per engine; docs/engines.md is the user's page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autopar.engines.capability import ENGINE_NAMES, ENGINES, EXPORT_ENGINES, get_engine, plan_reason
from autopar.engines.config import EngineConfig
from autopar.errors import AutoparError
from autopar.plan import Plan

__all__ = ["ENGINES", "ENGINE_NAMES", "EXPORT_ENGINES", "EngineConfig", "export_config", "get_engine",
           "plan_reason", "read_config"]

# What each export is called by default (``autopar export`` without -o prints it to stdout).
SUFFIX = {"megatron": ".args", "torchtitan": ".toml", "deepspeed": ".json", "accelerate": ".yaml"}


def export_config(plan: Plan, engine: str, *, plan_name: str, cluster: Any = None) -> str:
    """``plan`` in ``engine``'s own format; a feature the engine cannot express is one line naming it
    (never a nearby configuration). ``cluster``: the plan's priced profile (autopar.cluster.Cluster),
    whose software switches an engine with matching flags writes too (Megatron-LM's overlaps)."""
    from autopar.engines import accelerate, deepspeed, megatron, torchtitan

    if engine not in EXPORT_ENGINES:
        raise AutoparError(f"unknown engine {engine!r}; export to one of {', '.join(EXPORT_ENGINES)}")
    reason = plan_reason(get_engine(engine), plan)
    if reason:
        raise AutoparError(reason)
    if engine == "megatron":  # the one format with flags for the profile's software switches
        return megatron.export_megatron(plan, plan_name=plan_name, cluster=cluster)
    writer = {"torchtitan": torchtitan.export_torchtitan, "deepspeed": deepspeed.export_deepspeed,
              "accelerate": accelerate.export_accelerate}[engine]
    return writer(plan, plan_name=plan_name)


def read_config(engine: str, path: str | Path) -> EngineConfig:
    """The configuration the engine's file at ``path`` runs (``EngineConfig``); a file that cannot be
    read, or is not of that engine, is one line saying so."""
    from autopar.engines import accelerate, deepspeed, megatron, torchtitan

    if engine not in EXPORT_ENGINES:
        raise AutoparError(f"unknown engine {engine!r}; read from one of {', '.join(EXPORT_ENGINES)}")
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError:
        raise AutoparError(f"{path} is not a text file; give the {engine} configuration file") from None
    reader = {"megatron": megatron.read_megatron, "torchtitan": torchtitan.read_torchtitan,
              "deepspeed": deepspeed.read_deepspeed, "accelerate": accelerate.read_accelerate}[engine]
    return reader(text, source=str(path))
