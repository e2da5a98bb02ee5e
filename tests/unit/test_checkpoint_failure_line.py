"""A checkpoint that cannot be written or read says why in a few words: each rank's own error (an OS
error by its cause), not DCP's "CheckpointException ranks:dict_keys([0, 1])" and a traceback per rank."""

from __future__ import annotations

import errno
import traceback

from torch.distributed.checkpoint.api import CheckpointException

from autopar.executor.checkpoint.checkpoint import failure_line


def _pair(exc: BaseException) -> tuple[BaseException, traceback.StackSummary]:
    return exc, traceback.StackSummary()


def test_a_full_disk_on_every_rank_is_named_once() -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    exc = CheckpointException("save failed", {0: _pair(full), 1: _pair(OSError(errno.ENOSPC, "No space left on device"))})
    assert str(exc).startswith("CheckpointException ranks:dict_keys([0, 1])")
    assert failure_line(exc) == "No space left on device (ranks 0, 1)"


def test_different_causes_are_each_named_with_their_ranks() -> None:
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system")
    exc = CheckpointException("x", {0: _pair(wrapped), 3: _pair(ValueError("bad shard\nmore"))})
    assert failure_line(exc) == "Read-only file system (rank 0); bad shard (rank 3)"


def test_a_plain_error_is_its_first_line() -> None:
    assert failure_line(ValueError("first\nsecond")) == "first"
    assert failure_line(OSError(errno.ENOSPC, "No space left on device")) == "No space left on device"
