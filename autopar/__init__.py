"""autopar: plan and run hybrid-parallel PyTorch training.

The Python API (see ``autopar.api``)::

    autopar.plan(model_file, gpus=N, cluster=...) -> Plan         (the module autopar.plan, callable)
    autopar.estimate(model_file, plan, cluster=None) -> Estimate
    autopar.explain(plan, model=None, cluster=None) -> str         (the package autopar.explain, callable)
    autopar.apply_plan(model_file, plan) -> Executable             (inside an initialised process group)

``autopar.plan`` and ``autopar.explain`` are also the module/package of those names
(``from autopar.plan import Plan`` keeps working); their module objects are callable.
"""

__version__ = "0.1.0"

from autopar import explain, plan  # noqa: E402  (callable module and package: see their docstrings)
from autopar.api import apply_plan, estimate, trace  # noqa: E402
from autopar.plan import Plan, load_plan, save_plan  # noqa: E402

__all__ = ["Plan", "apply_plan", "estimate", "explain", "load_plan", "plan", "save_plan", "trace", "__version__"]
