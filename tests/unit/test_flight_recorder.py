"""Hang reports on NCCL (GPU readiness, B7), guarded on CPU: which collective the flight recorder
says a rank is stuck in, the recorder dump NCCL's watchdog writes before it aborts a rank, and the
launcher's one line naming the rank that hung rather than a survivor the watchdog aborted."""

from __future__ import annotations

import json
import os
import pickle
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from autopar.errors import EXIT_FAULT
from autopar.launch import flight_recorder as fr
from autopar.launch import local
from autopar.launch import rank as rank_side


def _entry(record_id: int, state: str, retired: bool, seq: int, name: str = "nccl:all_reduce", pg: str = "3") -> dict:
    return {"record_id": record_id, "pg_id": int(pg), "process_group": (pg, "mesh_dp"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "profiling_name": name, "input_sizes": [[1024, 8]], "state": state,
            "retired": retired, "is_p2p": False}


def _nccl_trace(*entries: dict) -> dict:
    return {"version": "2.9", "entries": list(entries),
            "pg_config": {"3": {"name": "3", "desc": "mesh_dp", "ranks": "[0, 1, 2]"}}}


def test_nccl_stuck_collective_is_the_oldest_not_completed() -> None:
    # NCCL runs ahead: the newest entry (#9) was queued after the one that never finished (#7)
    trace = _nccl_trace(_entry(1, "completed", True, 6), _entry(2, "started", False, 7),
                        _entry(3, "scheduled", False, 8, "nccl:_reduce_scatter_base"), _entry(4, "scheduled", False, 9))
    rec = fr.record_from_trace(trace)
    assert rec is not None and (rec.name, rec.seq, rec.group, rec.ranks) == ("nccl:all_reduce", 7, "mesh_dp", "[0, 1, 2]")


def test_gloo_failed_collective_is_the_newest() -> None:
    # gloo retires every entry (it runs collectives synchronously): the newest is the one that failed
    trace = _nccl_trace(_entry(1, "scheduled", True, 6), _entry(2, "scheduled", True, 7, "gloo:all_gather"))
    rec = fr.record_from_trace(trace, {"3": ("mesh_dp", "[0, 2]")})
    assert rec is not None and (rec.name, rec.seq, rec.ranks) == ("gloo:all_gather", 7, "[0, 2]")
    assert fr.record_from_trace({"entries": []}) is None


def test_dump_file_is_read_without_running_code(tmp_path: Path) -> None:
    path = fr.rank_dump(tmp_path, 2)
    path.write_bytes(pickle.dumps(_nccl_trace(_entry(1, "completed", True, 4), _entry(2, "started", False, 5))))
    rec, pending = fr.read_dump(path)
    assert pending and rec is not None and rec.seq == 5
    idle = fr.rank_dump(tmp_path, 1)
    idle.write_bytes(pickle.dumps(_nccl_trace(_entry(1, "completed", True, 4))))
    assert fr.read_dump(idle)[1] is False  # nothing pending: not waiting in a collective

    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, ("echo pwned",))

    bad = tmp_path / "fr_rank9"
    bad.write_bytes(pickle.dumps({"entries": [Evil()]}))
    assert fr.read_dump(bad) is None
    assert fr.read_dump(tmp_path / "fr_rank7") is None  # absent


def test_flight_recorder_dumps_into_the_launchers_status_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from autopar.executor.runtime.faults import enable_flight_recorder

    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AUTOPAR_STATUS_DIR", str(tmp_path))
    enable_flight_recorder()
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "fr_rank")
    assert fr.rank_dump(tmp_path, 3) == Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "3")  # torch appends the rank
    monkeypatch.delenv("AUTOPAR_STATUS_DIR")
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    enable_flight_recorder()  # under torchrun: torch's own dump location
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ


def test_live_reader_prefers_the_nccl_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._C._distributed_c10d as c10d_c

    from autopar.executor.runtime import faults

    nccl = _nccl_trace(_entry(1, "started", False, 11))
    generic = _nccl_trace(_entry(1, "scheduled", True, 2, "gloo:broadcast"))
    monkeypatch.setattr(c10d_c, "_dump_nccl_trace_json", lambda *a: json.dumps(nccl), raising=False)
    monkeypatch.setattr(c10d_c, "_dump_fr_trace_json", lambda *a: json.dumps(generic))
    monkeypatch.setattr(faults, "_group_table", lambda: {})
    assert faults.last_collective().seq == 11
    nccl["entries"] = []  # the NCCL recorder is empty (a gloo job on a CUDA build): the generic one
    assert faults.last_collective().name == "gloo:broadcast"


@dataclass
class _Proc:
    code: int | None

    def poll(self) -> int | None:
        return self.code


def _ranks(*codes: int | None) -> list[local._Rank]:
    return [local._Rank(rank=r, proc=_Proc(c)) for r, c in enumerate(codes)]  # type: ignore[arg-type]


def _dump(status: Path, rank: int, *entries: dict) -> None:
    fr.rank_dump(status, rank).write_bytes(pickle.dumps(_nccl_trace(*entries)))


ABRT = -int(signal.SIGABRT)


def test_launcher_names_the_hung_rank_not_the_aborted_survivors(tmp_path: Path) -> None:
    # ranks 0 and 2 waited in an all-reduce until NCCL's watchdog aborted them; rank 1 (asleep in
    # step 3) was still running and was stopped by the launcher
    ranks = _ranks(ABRT, None, ABRT)
    for r in (0, 2):
        _dump(tmp_path, r, _entry(1, "completed", True, 40), _entry(2, "started", False, 41))
    (tmp_path / "rank1").write_text("step 3\n")
    out = local._verdict(ranks, ranks[0], tmp_path, {1})
    assert out.code == EXIT_FAULT
    assert out.line.startswith("rank 1 hung in step 3; ranks 0, 2 waited for it in collective nccl:all_reduce #41")
    assert "rank 0 died" not in out.line


def test_launcher_hung_rank_aborted_too(tmp_path: Path) -> None:
    # every rank was aborted; rank 1 had nothing pending: the one the others waited for
    ranks = _ranks(ABRT, ABRT)
    _dump(tmp_path, 0, _entry(1, "started", False, 8))
    _dump(tmp_path, 1, _entry(1, "completed", True, 7))
    out = local._verdict(ranks, ranks[0], tmp_path, set())
    assert out.code == EXIT_FAULT and out.line.startswith("rank 1 hung; rank 0 waited for it in collective nccl:all_reduce #8")


def test_launcher_names_a_real_death_with_the_collective_the_others_waited_in(tmp_path: Path) -> None:
    ranks = _ranks(ABRT, -int(signal.SIGKILL))
    _dump(tmp_path, 0, _entry(1, "started", False, 12, "nccl:all_gather"))
    out = local._verdict(ranks, ranks[1], tmp_path, set())
    assert out.code == EXIT_FAULT
    assert out.line.startswith("rank 1 died (SIGKILL); the others waited for it in collective nccl:all_gather #12")


def test_sigabrt_without_a_dump_is_a_death(tmp_path: Path) -> None:
    # a native crash (glibc's abort), not the watchdog: that rank is the one that died
    ranks = _ranks(ABRT, None)
    out = local._verdict(ranks, ranks[0], tmp_path, {1})
    assert out.code == EXIT_FAULT and out.line.startswith("rank 0 died (SIGABRT)")


def test_mismatched_collectives_name_each_ranks(tmp_path: Path) -> None:
    ranks = _ranks(ABRT, ABRT)
    _dump(tmp_path, 0, _entry(1, "started", False, 5, "nccl:all_reduce"))
    _dump(tmp_path, 1, _entry(1, "started", False, 5, "nccl:broadcast"))
    out = local._verdict(ranks, ranks[0], tmp_path, set())
    assert out.code == EXIT_FAULT and "rank 0 in nccl:all_reduce #5" in out.line and "rank 1 in nccl:broadcast #5" in out.line


def test_deterministic_nccl_errors_are_not_peer_faults() -> None:
    """An NCCL error that repeats on a restart (invalid usage, an unhandled CUDA error, an
    out-of-memory in a communicator's set-up) is this rank's failure, not exit 4 (which
    --max-restarts would restart into the same error); a lost or hung peer still is."""
    import torch.distributed as dist

    from autopar.executor.runtime.faults import _is_distributed_error

    backend_error = getattr(dist, "DistBackendError", RuntimeError)
    assert not _is_distributed_error(backend_error("NCCL error in: ProcessGroupNCCL.cpp:2040, invalid usage "
                                                   "(run with NCCL_DEBUG=WARN for details), NCCL version 2.21.5"))
    assert not _is_distributed_error(RuntimeError("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO)"))
    assert not _is_distributed_error(backend_error("NCCL error: Failed to CUDA calloc 33554432 bytes: out of memory"))
    assert _is_distributed_error(backend_error("NCCL error: remote process exited or there was a network error"))
    assert _is_distributed_error(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert _is_distributed_error(RuntimeError("Timed out waiting 10000ms for recv operation to complete"))


def test_nccl_joins_with_its_device_and_bootstraps_on_loopback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """NCCL process groups start with the rank's device (``device_id``: the communicator comes up at
    the join, a missing peer fails there), gloo without; the launcher pins gloo's and NCCL's
    bootstrap sockets to loopback unless the user chose an interface."""
    import torch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert rank_side.process_group_options("nccl") == {"device_id": torch.device("cuda", 3)}
    assert rank_side.process_group_options("gloo") == {}

    job = local.LocalJob(argv=("-m", "autopar"), nproc=2)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    env = local.rank_env(job, 0, "run", tmp_path, 1234, "lo")
    assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert local.rank_env(job, 0, "run", tmp_path, 1234, "lo")["NCCL_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert "NCCL_SOCKET_IFNAME" not in local.rank_env(job, 0, "run", tmp_path, 1234, None)  # no loopback found
