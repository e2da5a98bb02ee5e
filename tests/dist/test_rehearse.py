"""`autopar rehearse` against real runs: on CPU ranks (gloo), the peak a rehearsal measures for a rank
(the executor on fake tensors over a fake process group) equals the peak `autopar validate` measures
for that rank in a real run of the same plan (allocated tensor bytes of one step, LiveBytes), within
5 %, for every dimension the executor runs, on a model the project did not write (Hugging Face Llama).
The rehearsal of a stage's first rank (rehearse's default) stands for every rank of that stage."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "zoo" / "hf_llama.py"  # 4 blocks
PROFILE = {2: "cpu-local-2", 4: "cpu-local-4"}
HOST = "host:\n  memory_bytes_per_node: 6.4e10\n  link_bandwidth_bytes_per_s: 5.0e9\n  optimizer_params_per_s: 1.0e8\n"

# name: (ranks, the plan's parallel section, micro-batch size); the rest of each plan is one written
# here (what the planner picks does not matter: the rehearsal and the run apply the same plan).
# Pipelining is one case, 1F1B over two stages with tp 2 in each: its stages hold what a pp-only
# run's hold (the schedule's micro-batches, receive buffers and blocks; tp without sp keeps stage
# activations whole), tp's shards besides; a pp-only case was a second real run of the same schedule.
CASES = {
    "dp-zero1": (2, {"dp": 2, "zero": 1}, 4),
    "tp-sp": (2, {"tp": 2, "sequence_parallel": True}, 8),
    "zero3": (2, {"dp": 2, "zero": 3}, 4),
    "cp": (2, {"cp": 2, "cp_kind": "allgather", "zero": 1}, 8),
    "offload": (2, {"dp": 2, "zero": 3, "offload": {"optimizer": True, "params": True, "grads": True}}, 4),
    "tp2-pp2-1f1b": (4, {"tp": 2, "pp": 2, "pp_schedule": "1f1b", "stages": [[0, 2], [2, 4]]}, 1),
}


@contextlib.contextmanager
def _validate_alongside(plan: Path, profile: str, cwd: Path) -> Iterator[Callable[[], dict]]:
    """`autopar validate PLAN` started in its own processes for the body to run beside; yields a
    function that waits for it and returns its --report (the real run's per-rank peaks). Both sides
    measure bytes, never time, so sharing the cores changes neither; a body that raises kills the run
    (its ranks follow their launcher: parent-death signal)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out, err = cwd / "validate.out", cwd / "validate.err"
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen([sys.executable, "-m", "autopar", "validate", str(plan), "--steps", "2", "--cluster",
                                 profile, "--report", "v.json"], cwd=cwd, env=env, stdout=fo, stderr=fe, text=True)

    def report() -> dict:
        code = proc.wait(timeout=600)
        assert code == 0, err.read_text()[-3000:]
        return json.loads((cwd / "v.json").read_text())

    try:
        yield report
    except BaseException:
        proc.kill()
        raise
    finally:
        proc.wait(timeout=600)


def _write_plan(case: str, tmp_path: Path) -> tuple[int, Path, str]:
    ranks, parallel, micro = CASES[case]
    profile = PROFILE[ranks]
    if "offload" in parallel:  # the CPU profiles give no host: section (a CPU's host is itself)
        text = (ROOT / "profiles" / f"{profile}.yaml").read_text()
        (tmp_path / "with-host.yaml").write_text(text.rstrip("\n") + "\n" + HOST)
        profile = str(tmp_path / "with-host.yaml")
    plan = {"version": 1, "model": {"file": str(MODEL), "num_blocks": 4},
            "cluster": {"profile": profile, "num_gpus": ranks, "gpus_per_node": ranks},
            "training": {"global_batch_size": 4 if "pp" in parallel else 8, "micro_batch_size": micro, "seq_len": 32, "dtype": "fp32",
                         "optimizer": "adam"},
            "parallel": {"dp": 1, "tp": 1, "pp": 1, **parallel}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    return ranks, tmp_path / "p.yaml", profile


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(CASES))
def test_rehearsed_peak_equals_the_real_runs(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autopar import api
    from autopar.rehearse import rehearsal_json

    ranks, plan, profile = _write_plan(case, tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the rehearsal's spawned ranks, as the real ranks
    # the real run (validate) and the rehearsal at once; the rehearsal in this process, as
    # `autopar rehearse --json` computes and prints it (the command itself: tests/cli/test_rehearse_cli.py)
    with _validate_alongside(plan, profile, tmp_path) as validated:
        # rehearse's default ranks: the first of every pipeline stage, which stands for its stage
        reh = {x["rank"]: x for x in rehearsal_json(api.rehearsal(str(plan), warn=lambda _line: None))["ranks"]}
        real = validated()
    per_stage = ranks // CASES[case][1].get("pp", 1)
    assert sorted(reh) == list(range(0, ranks, per_stage)), sorted(reh)
    assert sorted(row["rank"] for row in real["ranks"]) == list(range(ranks))
    for row in real["ranks"]:
        measured = row["measured_peak_bytes"] - real["reserve_bytes"]  # tensors of one real step
        x = reh[row["rank"] - row["rank"] % per_stage]
        # a CPU rank's host and device are one memory: what offload keeps on the host counts too
        rehearsed = x["peak_bytes"] - x["parts"]["reserve"] + x.get("host_bytes", 0.0)
        assert abs(rehearsed - measured) <= 0.05 * measured, (case, row["rank"], rehearsed, measured)
