"""`autopar rehearse` against real runs: on CPU ranks (gloo), the peak a rehearsal measures for a rank
(the executor on fake tensors over a fake process group) equals the peak `autopar validate` measures
for that rank in a real run of the same plan (allocated tensor bytes of one step, LiveBytes), within
5 %, for every dimension the executor runs, on a model the project did not write (Hugging Face Llama)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "zoo" / "hf_llama.py"
PROFILE = {2: "cpu-local-2", 4: "cpu-local-4"}

# name: (ranks, plan constraints)
CASES = {
    "dp-zero1": (2, ["--dp", "2", "--zero", "1"]),
    "tp-sp": (2, ["--tp", "2", "--sp", "on"]),
    "pp-1f1b": (2, ["--pp", "2", "--schedule", "1f1b", "--micro-batch", "1"]),
    "zero3": (2, ["--dp", "2", "--zero", "3"]),
    "cp": (2, ["--cp", "2"]),
    "offload": (2, ["--dp", "2", "--zero", "3", "--offload", "params"]),
    "dp2-tp2-pp": (4, ["--dp", "1", "--tp", "2", "--pp", "2", "--micro-batch", "1"]),
}


def _cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "autopar", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(CASES))
def test_rehearsed_peak_equals_the_real_runs(case: str, tmp_path: Path) -> None:
    ranks, constraints = CASES[case]
    profile = PROFILE[ranks]
    if "--offload" in constraints:  # the CPU profiles give no host: section (a CPU's host is itself)
        text = (ROOT / "profiles" / f"{profile}.yaml").read_text()
        host = "host:\n  memory_bytes_per_node: 6.4e10\n  link_bandwidth_bytes_per_s: 5.0e9\n  optimizer_params_per_s: 1.0e8\n"
        (tmp_path / "with-host.yaml").write_text(text.rstrip("\n") + "\n" + host)
        profile = str(tmp_path / "with-host.yaml")
    r = _cli("plan", str(MODEL), "--gpus", str(ranks), "--cluster", profile, *constraints, "-o", "p.yaml",
             "--quiet", cwd=tmp_path)
    if r.returncode == 2 and "offload" in r.stderr and "host" in r.stderr:
        pytest.skip(f"{profile} prices no host offload: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    r = _cli("validate", "p.yaml", "--steps", "2", "--report", "v.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    real = json.loads((tmp_path / "v.json").read_text())
    r = _cli("rehearse", "p.yaml", "--ranks", ",".join(str(x) for x in range(ranks)), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    reh = {x["rank"]: x for x in json.loads(r.stdout)["ranks"]}
    for row in real["ranks"]:
        measured = row["measured_peak_bytes"] - real["reserve_bytes"]  # tensors of one real step
        x = reh[row["rank"]]
        # a CPU rank's host and device are one memory: what offload keeps on the host counts too
        rehearsed = x["peak_bytes"] - x["parts"]["reserve"] + x.get("host_bytes", 0.0)
        assert abs(rehearsed - measured) <= 0.05 * measured, (case, row["rank"], rehearsed, measured)
