"""The checkpoint record: ``meta.json`` (what a save records beside DCP's shards) and its error.

Plain JSON and no torch, so that the integrity checks (executor/checkpoint/integrity.py), the launcher's
``--resume`` check (commands/run.py) and the checkpointer (executor/checkpoint/checkpoint.py) share it
without importing each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError

FORMAT = 1
LATEST = "latest"
META = "meta.json"
MAX_META_BYTES = 256 * 2**20  # the loss history of ten million steps fits


class CheckpointError(AutoparError):
    """A checkpoint directory that cannot be resumed from (missing, incomplete, another model)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    """What ``meta.json`` records next to the shards (written by rank 0, last)."""

    step: int  # optimizer steps completed = index of the next step (the data position)
    seed: int
    lr: float
    world_size: int
    parallel: dict[str, Any]
    global_batch_size: int
    num_blocks: int
    losses: tuple[float, ...]  # loss of every step so far, across resumes
    format: int = FORMAT
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {size, sha256}, all but meta.json

    def to_json(self) -> str:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["losses"] = list(self.losses)
        return json.dumps(d, indent=1) + "\n"

    @staticmethod
    def from_file(path: Path) -> "CheckpointMeta":
        try:
            if path.stat().st_size > MAX_META_BYTES:
                raise CheckpointError(f"{path} is larger than {MAX_META_BYTES // 2**20} MiB; not an autopar checkpoint record")
            d = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(d, dict) or not isinstance(d.get("files", {}), dict):
                raise ValueError("not a JSON object")
            if d.get("format") != FORMAT:
                raise CheckpointError(f"{path}: checkpoint format {d.get('format')!r}, this autopar reads {FORMAT}")
            d["losses"] = tuple(float(x) for x in d["losses"])
            return CheckpointMeta(**d)
        except CheckpointError:
            raise
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise CheckpointError(f"{path} is not a readable autopar checkpoint record ({type(exc).__name__})") from None
