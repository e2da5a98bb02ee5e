"""How a run's state is saved and found again: sharded DCP checkpoints (``checkpoint.py``), their
``meta.json`` record (``checkpoint_meta.py``) and the integrity check that picks one to resume."""
