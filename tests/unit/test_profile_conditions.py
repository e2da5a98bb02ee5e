"""A measured profile's conditions: recorded, read from old files, and checked against each run."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autopar.cluster import cluster_from_dict, load_cluster
from autopar.errors import ClusterError
from autopar.profile_conditions import RunConditions, default_dtype, price_for_run, ranks_on_host, slowdown
from autopar.profile_tables import conditions_of

ROOT = Path(__file__).resolve().parents[2]
CPU2 = ROOT / "profiles" / "cpu-local-2.yaml"
ZOO = ROOT / "examples" / "zoo" / "odd_names_decoder.py"


def _data(**device) -> dict:
    data = yaml.safe_load(CPU2.read_text(encoding="utf-8"))
    data["measured"]["device"].update(device)
    return data


def _cluster(**device):  # noqa: ANN202
    return cluster_from_dict(_data(**device), "p")


def test_an_old_profile_loads_and_its_conditions_are_read_from_what_it_has() -> None:
    c = load_cluster(str(CPU2))  # written before the conditions were recorded: no dtype/cores/curve keys
    cond = conditions_of(c.measured)
    assert (cond.device_type, cond.dtype, cond.concurrent_ranks, cond.threads_per_rank) == ("cpu", "fp32", 2, 1)
    assert cond.cores is None and cond.contention == () and cond.comm_ranks == 2 and cond.measures_compute
    assert default_dtype(c) == "fp32"
    assert default_dtype(load_cluster("a100-80g")) == "bf16"  # a datasheet profile: the GPU default


def test_a_dtype_mismatch_is_a_one_line_error_that_says_how_to_fix_it() -> None:
    with pytest.raises(ClusterError) as exc:
        price_for_run(_cluster(), RunConditions(dtype="bf16", ranks_on_host=2), profile_label="prof.yaml",
                      model_label="model.py")
    msg = str(exc.value)
    assert "\n" not in msg and "measured in fp32" in msg and "bf16" in msg
    assert "--dtype fp32" in msg and "autopar profile model.py --device cpu --dtype bf16 -o prof.yaml" in msg


def test_the_same_conditions_price_as_measured_without_a_word() -> None:
    c = _cluster(cores=2)
    priced = price_for_run(c, RunConditions(dtype="fp32", ranks_on_host=2), profile_label="p")
    assert priced.warnings == () and priced.cluster.peak_flops == c.peak_flops
    assert priced.cluster.measured.layers == c.measured.layers


def test_more_ranks_than_the_profile_time_share_the_cores_and_warn_in_one_line() -> None:
    c = _cluster(cores=2)  # measured as 2 ranks on 2 cores, no contention curve
    priced = price_for_run(c, RunConditions(dtype="fp32", ranks_on_host=4), profile_label="prof.yaml",
                           model_label="model.py")
    (line,) = [w for w in priced.warnings if "rank(s) sharing" in w]
    assert "\n" not in line and "runs 4" in line and "--load-ranks 4 -o prof.yaml" in line and "2.00" in line
    before = c.measured.layers.regions["block"][0]
    after = priced.cluster.measured.layers.regions["block"][0]
    assert after.fwd_s == pytest.approx(2 * before.fwd_s) and after.bwd_s == pytest.approx(2 * before.bwd_s)
    assert priced.cluster.peak_flops == pytest.approx(c.peak_flops / 2)
    link, base = priced.cluster.intra_node, c.intra_node  # collectives measured on 2 ranks: 4 share the cores too
    assert link.rendezvous_s == pytest.approx(2 * base.rendezvous_s)
    assert link.fit("all_reduce")[1] == pytest.approx(base.fit("all_reduce")[1] / 2)
    assert priced.cluster.gpus_per_node == 4  # a CPU profile: every rank on this machine


def test_a_contention_curve_prices_its_rank_counts_silently() -> None:
    c = _cluster(cores=2, contention=[[1, 0.010], [2, 0.012], [4, 0.024]])
    priced = price_for_run(c, RunConditions(dtype="fp32", ranks_on_host=4), profile_label="p")
    assert not [w for w in priced.warnings if "sharing" in w]
    assert priced.cluster.peak_flops == pytest.approx(c.peak_flops / 2)  # 0.024 / 0.012
    cond = conditions_of(c.measured)
    assert slowdown(cond, 3) == pytest.approx(0.012 * 2 ** 0.5849625, rel=1e-3)  # log-log between 2 and 4
    assert slowdown(cond, 8) == pytest.approx(0.048)  # beyond the curve: the cores' share
    one = price_for_run(c, RunConditions(dtype="fp32", ranks_on_host=1), profile_label="p")
    assert one.cluster.peak_flops == pytest.approx(c.peak_flops * 0.012 / 0.010)


def test_a_dip_in_the_contention_curve_is_read_as_noise() -> None:
    """More ranks on the machine never make a rank faster: a curve point below an earlier one
    prices as the earlier one (the running maximum), and the points after it are read as measured."""
    c = _cluster(cores=2, contention=[[1, 0.010], [2, 0.009], [4, 0.024]])
    cond = conditions_of(c.measured)
    assert slowdown(cond, 2) == pytest.approx(0.010)
    assert slowdown(cond, 4) == pytest.approx(0.024)
    assert slowdown(cond, 3) == pytest.approx(0.010 * 2.4 ** 0.5849625, rel=1e-3)  # log-log, from the max
    two = price_for_run(c, RunConditions(dtype="fp32", ranks_on_host=2), profile_label="p")
    one = price_for_run(c, RunConditions(dtype="fp32", ranks_on_host=1), profile_label="p")
    assert two.cluster.peak_flops == pytest.approx(one.cluster.peak_flops)


def test_validate_conditions_other_device_is_an_error_soft_ones_warn() -> None:
    c = _cluster(cores=2)
    with pytest.raises(ClusterError, match="measured on cpu, this run is on cuda"):
        price_for_run(c, RunConditions(dtype="fp32", ranks_on_host=2, device_type="cuda"), profile_label="p")
    priced = price_for_run(c, RunConditions(dtype="fp32", ranks_on_host=2, device_type="cpu", device_name="Other CPU",
                                            threads_per_rank=4, torch_version="3.1.0"), profile_label="p")
    text = "\n".join(priced.warnings)
    assert len(priced.warnings) == 3 and "1 thread(s) per rank" in text and "Other CPU" in text and "torch" in text


def test_a_malformed_contention_curve_is_a_profile_error() -> None:
    with pytest.raises(ClusterError, match="contention"):
        conditions_of(_cluster(contention=[[0, 0.1]]).measured)


def test_ranks_on_host_of_a_cpu_profile_is_the_whole_plan() -> None:
    assert ranks_on_host(_cluster(), 4, 2) == 4
    assert ranks_on_host(load_cluster("a100-80g"), 16, 8) == 8


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "autopar", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_plan_cli_dtype_mismatch_and_concurrency_messages(tmp_path) -> None:
    prof = tmp_path / "prof.yaml"
    data = _data(cores=2)
    prof.write_text(yaml.safe_dump(data), encoding="utf-8")
    r = _cli("plan", str(ZOO), "--gpus", "2", "--profile", str(prof), "--dtype", "bf16", "-o", str(tmp_path / "a.yaml"),
             cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and not (tmp_path / "a.yaml").exists()
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("autopar: error:")]
    assert "measured in fp32" in line and "--dtype fp32" in line
    # no --dtype: the profile's fp32; 4 ranks against a profile of 2 (no curve): one warning line
    r = _cli("plan", str(ZOO), "--gpus", "4", "--profile", str(prof), "-o", str(tmp_path / "b.yaml"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = yaml.safe_load((tmp_path / "b.yaml").read_text())
    assert plan["training"]["dtype"] == "fp32" and plan["training"]["global_batch_size"] == 32  # 8 x N on CPU
    warn = [x for x in r.stderr.splitlines() if "rank(s) sharing" in x]
    assert len(warn) == 1 and warn[0].startswith("autopar: warning:") and "--load-ranks 4" in warn[0]
    # estimate prices the plan the same way and says the same
    r = _cli("estimate", str(tmp_path / "b.yaml"), "--profile", str(prof), "--no-rank", cwd=tmp_path)
    assert r.returncode == 0 and len([x for x in r.stderr.splitlines() if "rank(s) sharing" in x]) == 1
    bad = copy.deepcopy(plan)
    bad["training"]["dtype"] = "bf16"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(bad), encoding="utf-8")
    r = _cli("estimate", str(tmp_path / "c.yaml"), "--profile", str(prof), "--no-rank", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("autopar: error:") == 1 and "measured in fp32" in r.stderr


def test_a_profile_written_again_at_the_same_path_is_read_again(tmp_path) -> None:
    # A user (and the closed-loop benchmark) re-profiles into prof.yaml and plans again in the same
    # process: the second plan must be priced from the new file, not the first one kept in memory.
    path = tmp_path / "prof.yaml"
    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "profiles" / "cpu-local-2.yaml").read_text())
    path.write_text(yaml.safe_dump(data))
    first = load_cluster(str(path))
    assert load_cluster(str(path)) is first  # unchanged: served from memory
    data["gpu"]["memory_bytes"] = first.memory_bytes * 2
    path.write_text(yaml.safe_dump(data) + "# written again\n")
    assert load_cluster(str(path)).memory_bytes == pytest.approx(first.memory_bytes * 2)
