"""autopar: plan and run hybrid-parallel PyTorch training.

The Python API (see ``autopar.api``)::

    autopar.plan(model_file, gpus=N, cluster=...) -> Plan         (the module autopar.plan, callable)
    autopar.estimate(model_file, plan, cluster=None) -> Estimate
    autopar.explain(plan, model=None, cluster=None) -> str         (the package autopar.explain, callable)
    autopar.apply_plan(model_file, plan) -> Executable             (inside an initialised process group)

``autopar.plan`` and ``autopar.explain`` are also the module/package of those names
(``from autopar.plan import Plan`` keeps working); their module objects are callable.

Why callable modules: importing a submodule always sets the package attribute to the module, so a
function ``plan`` (or ``explain``) defined here would be silently replaced by the module of that
name whenever anything imports it, and renaming the modules would break every import and the
plan-file contract's home. So the module objects themselves are made callable, here, once: their
class becomes a ``ModuleType`` subclass (allowed since Python 3.5) whose ``__call__`` delegates to
``autopar.api``. Attribute access, ``import autopar.plan``, pickling of Plan objects and
``from autopar.plan import ...`` are unchanged, and neither module imports the API (no import circle).
"""

from __future__ import annotations

import types
from typing import Any

from autopar import api, explain, plan
from autopar.api import apply_plan, estimate, trace
from autopar.plan import Plan, load_plan, save_plan
from autopar.version import __version__


class _CallablePlanModule(types.ModuleType):
    """The ``autopar.plan`` module, callable as ``autopar.api.plan``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Plan:
        return api.plan(*args, **kwargs)


class _CallableExplainPackage(types.ModuleType):
    """The ``autopar.explain`` package, callable as ``autopar.api.explain``."""

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        return api.explain(*args, **kwargs)


plan.__class__ = _CallablePlanModule
explain.__class__ = _CallableExplainPackage

__all__ = ["Plan", "apply_plan", "estimate", "explain", "load_plan", "plan", "save_plan", "trace", "__version__"]
