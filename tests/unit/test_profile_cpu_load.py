"""CPU runs with as many ranks as cores or more: the load helpers and the no-free-overlap rule."""

from __future__ import annotations

import os
import time

import pytest

from autopar.cluster import cluster_from_dict
from autopar.profiler import profile_file
from autopar.profiler.load import start_load, stop_load, wait_ready


def _spec(monkeypatch, cores: int, load_ranks: int, comm_ranks: int) -> dict:
    monkeypatch.setattr(profile_file, "usable_cores", lambda: cores)
    info = {"name": "cpu-x", "type": "cpu", "threads": 1, "load_ranks": load_ranks}
    measured = {"comm": {"ranks": comm_ranks, "link": "intra_node", "collectives": {}}} if comm_ranks else {}
    data: dict = {}
    profile_file.derived_spec(data, "p", info, measured, None)
    return data


@pytest.mark.parametrize(("cores", "load_ranks", "comm_ranks", "busy"),
                         [(2, 4, 0, True), (2, 1, 4, True), (2, 1, 2, True), (8, 4, 4, False), (8, 1, 0, False)])
def test_overlap_is_free_only_with_an_idle_core(monkeypatch, cores, load_ranks, comm_ranks, busy) -> None:
    data = _spec(monkeypatch, cores, load_ranks, comm_ranks)
    assert data["software"]["overlap_grad_reduce"] is (not busy)
    assert data["efficiency"].get("overlap_cost_fraction") == (1.0 if busy else None)
    c = cluster_from_dict(data, "p")
    assert c.overlap_grad_reduce is (not busy)
    assert c.overlap_cost_fraction == (1.0 if busy else 0.1)


def test_a_busy_profile_re_derived_on_a_quiet_setting_drops_the_override(monkeypatch) -> None:
    data = _spec(monkeypatch, 2, 4, 0)
    info = {"name": "cpu-x", "type": "cpu", "threads": 1, "load_ranks": 1}
    monkeypatch.setattr(profile_file, "usable_cores", lambda: 8)
    profile_file.derived_spec(data, "p", info, {}, None)
    assert data["software"]["overlap_grad_reduce"] is True and "overlap_cost_fraction" not in data["efficiency"]


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat", encoding="ascii").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_load_helpers_keep_a_core_busy_until_stopped() -> None:
    procs = start_load(1, "cpu", "examples/gpt_small.py", 1)
    try:
        assert len(procs) == 1
        wait_ready(procs, timeout_s=120)  # its "ready" line: the loop has started
        start = _cpu_seconds(procs[0].pid)
        deadline = time.monotonic() + 60  # a shared machine may give it a small share of a core
        while _cpu_seconds(procs[0].pid) < start + 1.0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert procs[0].poll() is None  # still running: the model loop does not exit on its own
        assert _cpu_seconds(procs[0].pid) >= start + 1.0  # and it keeps computing
    finally:
        stop_load(procs)
    assert procs[0].poll() is not None
    assert start_load(2, "cuda", "examples/gpt_small.py", 1) == []


def test_a_new_cuda_profile_takes_the_nodes_gpus(monkeypatch) -> None:
    """(GPU readiness, M10) a CUDA profile written without --gpus-per-node or a --comm run takes the
    GPUs the node shows (it took 1: plan then refused tp > 1 as crossing nodes) and says its links
    are placeholders."""
    monkeypatch.setattr(profile_file, "_device_memory_bytes", lambda info: 85520809984.0)
    info = {"name": "NVIDIA H100 80GB HBM3", "type": "cuda", "threads": 1, "load_ranks": 1, "device_count": 8}
    data: dict = {}
    notes = profile_file.derived_spec(data, "p", info, {"fitted": {"peak_flops": 7e14}}, None)
    assert data["network"]["gpus_per_node"] == 8
    assert len(notes) == 1 and "placeholder links" in notes[0] and "--comm" in notes[0]
    assert cluster_from_dict(data, "p").gpus_per_node == 8
    data = {}
    profile_file.derived_spec(data, "p", info, {}, 4)
    assert data["network"]["gpus_per_node"] == 4  # --gpus-per-node wins
