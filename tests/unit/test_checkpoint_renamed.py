"""A checkpoint directory renamed to another step is not trusted over the step recorded inside it:
the newest checkpoint is found by its name, so a renamed older one would resume training at the wrong
data position and step. It is reported as damaged, and the resume falls back to an intact one."""

from __future__ import annotations

from pathlib import Path

from autopar.executor.checkpoint.checkpoint_meta import META, CheckpointMeta
from autopar.executor.checkpoint.integrity import choose, damage, file_record


def _checkpoint(directory: Path, name: str, step: int) -> Path:
    path = directory / name
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"dcp metadata")
    (path / "__0_0.distcp").write_bytes(b"shard" * 10)
    meta = CheckpointMeta(step=step, seed=0, lr=1e-3, world_size=1, parallel={"dp": 1}, global_batch_size=4,
                          num_blocks=4, losses=tuple(1.0 for _ in range(step)), files=file_record(path))
    (path / META).write_text(meta.to_json())
    return path


def test_a_renamed_checkpoint_is_damaged_and_skipped(tmp_path: Path) -> None:
    good = _checkpoint(tmp_path, "step-4", 4)
    renamed = _checkpoint(tmp_path, "step-9", 2)  # step-2 renamed to look newest
    assert damage(good) is None
    assert "named for step 9 but it holds step 2" in damage(renamed)
    warnings: list[str] = []
    assert choose(tmp_path, warn=warnings.append) == good
    assert len(warnings) == 1 and "renamed" in warnings[0]
