"""``autopar explain``: a plan's mesh groups, stages, memory and communication; its predicted timeline.

=================  ===========================================================================
mesh.py            which global ranks form each tp/cp/dp/pp group, on which node, over which link
volume.py          communication volume per step per collective and mesh axis (formulas inside)
trace.py           simulated pipeline schedule (GPipe, 1F1B, interleaved) as a Perfetto trace
explanation.py     gathers the facts from the cost model and formats the tables
=================  ===========================================================================

The command, ``autopar explain PLAN.yaml [MODEL.py] [--cluster] [--trace out.json]``, is
autopar/commands/explain.py. The package object is callable: ``autopar.explain(plan, model=None,
cluster=None) -> str`` is ``autopar.api.explain`` (``autopar/__init__.py`` makes it so, as it does for ``autopar.plan``).
"""
