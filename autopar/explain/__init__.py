"""``autopar explain``: a plan's mesh groups, stages, memory and communication; its predicted timeline.

=================  ===========================================================================
mesh.py            which global ranks form each tp/cp/dp/pp group, on which node, over which link
volume.py          communication volume per step per collective and mesh axis (formulas inside)
trace.py           simulated pipeline schedule (GPipe, 1F1B, interleaved) as a Perfetto trace
explanation.py     gathers the facts from the cost model and formats the tables
cli.py             ``autopar explain PLAN.yaml [MODEL.py] [--cluster] [--trace out.json]``
=================  ===========================================================================

The package object is callable: ``autopar.explain(plan, model=None, cluster=None) -> str`` is
``autopar.api.explain``. A plain function named ``explain`` in ``autopar/__init__`` would be
replaced by this package the moment ``autopar.explain.cli`` (or any submodule) is imported, since
importing a submodule sets the parent's attribute; a callable package keeps both meanings (see the
same device at the end of ``autopar/plan.py``).
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    """This package, callable as ``autopar.api.explain``."""

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        from autopar.api import explain

        return explain(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
