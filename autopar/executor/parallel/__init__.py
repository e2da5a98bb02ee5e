"""How a plan is applied to the model: the mesh, each kind of parallelism, recompute and offload,
composed in a fixed order by ``apply.py`` (this folder mirrors ``autopar/cost/``)."""
