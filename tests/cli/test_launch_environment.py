"""Start-up faults of the launch environment: each exits 2 with one line before any rank starts,
where it ended as a rendezvous that never completed (a rank reported hung, exit 4)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from autopar.launch.environment import environment_fault, port_in_use

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "examples" / "mlp.py"

GOOD = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "1", "WORLD_SIZE": "2"}


@pytest.mark.parametrize("env,nproc,says", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, 2, "RANK=0 and WORLD_SIZE=2 are set in the environment"),
    ({"WORLD_SIZE": "4"}, 2, "unset WORLD_SIZE"),
    ({"RANK": "0"}, None, "RANK=0 is set in the environment but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "4"}, None, "WORLD_SIZE=4 is set in the environment but RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, None, "MASTER_ADDR and MASTER_PORT are not"),
    ({**GOOD, "MASTER_ADDR": ""}, None, "MASTER_ADDR is not"),
    ({**GOOD, "MASTER_PORT": "99999"}, None, "MASTER_PORT=99999 in the environment is not a port number"),
    ({**GOOD, "RANK": "2"}, None, "RANK=2 in the environment is not an integer from 0 to WORLD_SIZE - 1 = 1"),
    ({**GOOD, "WORLD_SIZE": "two"}, None, "WORLD_SIZE=two in the environment is not a positive integer"),
])
def test_each_fault_is_one_line_naming_what_to_change(env: dict, nproc: int | None, says: str) -> None:
    line = environment_fault(env, nproc)
    assert line is not None and says in line and "\n" not in line


@pytest.mark.parametrize("env,nproc", [
    ({}, None), ({}, 2), (GOOD, None), ({"WORLD_SIZE": "1"}, None), ({"RANK": "0", "WORLD_SIZE": "1"}, None),
    # a rank autopar's own launcher started carries its own variables (launch/local.py rank_env)
    ({**GOOD, "AUTOPAR_LOOPBACK_STORE": "1", "AUTOPAR_LAUNCHER_PID": "1"}, 2),
    # under torchrun its agent owns the ports: a busy MASTER_PORT is not rank 0's to check
    ({**GOOD, "RANK": "0", "MASTER_PORT": "BUSY", "TORCHELASTIC_RUN_ID": "x"}, None),
])
def test_a_sound_environment_passes(env: dict, nproc: int | None) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if env.get("MASTER_PORT") == "BUSY":
            env = {**env, "MASTER_PORT": str(taken.getsockname()[1])}
        assert environment_fault(env, nproc) is None


def test_a_busy_port_is_named_for_the_rank_that_serves_the_store() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
        env = {**GOOD, "RANK": "0", "MASTER_PORT": str(port)}
        assert f"MASTER_PORT={port} is already in use on 127.0.0.1" in environment_fault(env, None)
        assert environment_fault({**env, "RANK": "1"}, None) is None  # a client does not bind
    assert not port_in_use("127.0.0.1", port)
    assert not port_in_use("no-such-host.invalid", port)


def _run(tmp_path: Path, extra_env: dict, *args: str) -> subprocess.CompletedProcess:
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({
        "version": 1, "model": {"file": str(MLP), "num_blocks": 12},
        "cluster": {"profile": "cpu-local-2", "num_gpus": 2, "gpus_per_node": 2},
        "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 1, "dtype": "fp32"},
        "parallel": {"dp": 2, "tp": 1, "pp": 1}}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(extra_env, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "autopar", "run", str(plan), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("extra_env,args,says", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, ("--nproc-per-node", "2"), "are set in the environment"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, (), "MASTER_ADDR and MASTER_PORT are not"),
])
def test_autopar_run_names_the_fault_before_any_rank_starts(tmp_path: Path, extra_env: dict, args: tuple,
                                                             says: str) -> None:
    start = time.monotonic()
    got = _run(tmp_path, extra_env, *args, "--timeout", "600")
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: ") and says in lines[0], got.stderr
    assert time.monotonic() - start < 60  # not the rendezvous timeout
