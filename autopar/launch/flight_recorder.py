"""Reading torch's collective flight recorder: which collective a rank was stuck in.

torch records every collective of a process in a ring buffer (``TORCH_FR_BUFFER_SIZE``). Two ways
to read it, one format:

* **Live** (``executor/runtime/faults.py``): a rank whose collective failed asks its own process
  (``_dump_nccl_trace_json`` where the build has ProcessGroupNCCL's recorder, else the generic
  ``_dump_fr_trace_json``, which gloo fills).
* **After an NCCL timeout**: ProcessGroupNCCL's watchdog aborts the process (SIGABRT) before Python
  can report, but with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` it first writes the recorder to
  ``TORCH_FR_DUMP_TEMP_FILE`` + rank (a pickle of the same dict). Under autopar's launcher that
  prefix is the job's status directory (``dump_prefix``), and the launcher reads the dumps of the
  ranks that died that way (``read_dump``), so its one line names the rank that hung and the
  collective the others waited in, not a healthy rank the watchdog aborted.

Which entry is "the" collective: NCCL runs collectives asynchronously, so a rank's newest entry is
often work queued after the stuck one; the stuck one is the oldest entry not completed
(``state`` scheduled or started, not retired). gloo runs them synchronously and retires every
entry: there the newest entry is the one that failed.

Pure Python: no torch import (the launcher reads dumps without importing torch).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

DUMP_PREFIX = "fr_rank"  # the dump of rank r is <status dir>/fr_rank<r>


@dataclass(frozen=True, kw_only=True)
class CollectiveRecord:
    """One collective of a rank's flight recorder (the one it failed or was stuck in)."""

    name: str  # e.g. "nccl:all_reduce", "gloo:all_gather"
    group: str  # group description, e.g. "mesh_dp" or "default_pg"
    ranks: str  # e.g. "[0, 2]"
    seq: int  # the group's collective (or p2p) sequence number
    sizes: str  # input sizes, e.g. "[[5184]]"

    def describe(self) -> str:
        return f"{self.name} #{self.seq} on group {self.group} ranks {self.ranks}, input sizes {self.sizes}"


def dump_prefix(status_dir: str | Path) -> str:
    """``TORCH_FR_DUMP_TEMP_FILE`` for ranks whose launcher reads the dumps from ``status_dir``."""
    return str(Path(status_dir) / DUMP_PREFIX)


def _pending(entry: Mapping[str, Any]) -> bool:
    """Whether a recorder entry's collective had not completed (NCCL: scheduled or started, not retired)."""
    return str(entry.get("state", "")) in ("scheduled", "started") and not entry.get("retired", False)


def stuck_entry(entries: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The entry a rank is stuck in (module docstring): the oldest not completed, else the newest."""
    if not entries:
        return None
    pending = [e for e in entries if _pending(e)]
    if pending:
        return min(pending, key=lambda e: int(e.get("record_id", 0) or 0))
    return max(entries, key=lambda e: int(e.get("record_id", 0) or 0))


def record_from_trace(trace: Mapping[str, Any], groups: Mapping[str, tuple[str, str]] | None = None) -> CollectiveRecord | None:
    """The stuck collective of a recorder ``trace`` (the dict both dump functions produce). ``groups``:
    process-group name -> (description, ranks) from the live process, else the trace's pg_config."""
    entry = stuck_entry(list(trace.get("entries") or []))
    if entry is None:
        return None
    pg = [str(x) for x in (entry.get("process_group") or ("?", "?"))] + ["?", "?"]
    config = trace.get("pg_config") or {}
    desc, ranks = (groups or {}).get(pg[0], ("", ""))
    if not ranks and isinstance(config, Mapping):
        c = config.get(pg[0]) or {}
        desc, ranks = str(c.get("desc") or pg[1]), str(c.get("ranks") or "?")
    seq = entry.get("collective_seq_id") if not entry.get("is_p2p") else entry.get("p2p_seq_id")
    return CollectiveRecord(
        name=str(entry.get("profiling_name", "?")), group=desc or pg[1], ranks=ranks or "?",
        seq=int(seq or entry.get("collective_seq_id") or entry.get("p2p_seq_id") or 0),
        sizes=str(entry.get("input_sizes", "?")).replace(" ", ""),
    )


class _PlainUnpickler(pickle.Unpickler):
    """The recorder's dump holds only dicts, lists, tuples, strings, numbers and None: refuse any
    class, so a dump file can never run code."""

    def find_class(self, module: str, name: str) -> Any:  # noqa: ANN401
        raise pickle.UnpicklingError(f"flight-recorder dump refers to {module}.{name}")


def read_dump(path: str | Path) -> tuple[CollectiveRecord | None, bool] | None:
    """(the stuck collective, whether any collective was still pending) in the dump file ``path``;
    None when it is absent or unreadable. A rank with nothing pending was not waiting in a
    collective: the one its peers waited for."""
    try:
        trace = _PlainUnpickler(io.BytesIO(Path(path).read_bytes())).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError):
        return None
    if not isinstance(trace, Mapping):
        return None
    return record_from_trace(trace), any(_pending(e) for e in trace.get("entries") or [])


def rank_dump(status_dir: str | Path, rank: int) -> Path:
    return Path(status_dir) / f"{DUMP_PREFIX}{rank}"
