"""Rehearse a plan at full scale on one CPU process: the real executor on fake tensors over a fake
process group, one training step per chosen rank under torch's memory tracker, beside the cost
model's prediction (``autopar rehearse``). See docs/rehearse.md.

- ``fake``: the fake world (process group, fake tensors, the two torch parts that read values);
- ``tracker``: the step's peak memory by part (MemTracker);
- ``rank``: one rank rehearsed with the executor's own code;
- ``compare``: the ranks of a plan beside the cost model, JSON and table.
"""

from autopar.rehearse.compare import RankRehearsal, Rehearsal, default_ranks, format_rehearsal, rehearsal_json, rehearse

__all__ = ["RankRehearsal", "Rehearsal", "default_ranks", "format_rehearsal", "rehearsal_json", "rehearse"]
