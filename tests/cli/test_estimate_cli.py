"""``autopar estimate`` (text and the --json contract of docs/design.md §3), ``autopar profiles`` and the help texts.

The text estimate, the help texts, ``profiles`` and ``--version`` run ``python -m autopar`` as a
subprocess; the JSON estimates compared with one another run in children forked off the warm CLI
server (``run_cli_forked``, tests/cli/cli_server.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

EXAMPLE = ("examples/gpt.py", "plans/gpt3-175b-megatron-64gpu.yaml")
CONTRACT_MEMORY = {"params", "grads", "optimizer", "activations", "other"}


@pytest.fixture(scope="module")
def text_run(run_cli):
    return run_cli("estimate", *EXAMPLE)


@pytest.fixture(scope="module")
def json_run(run_cli_forked):
    return run_cli_forked("estimate", *EXAMPLE, "--json")


def test_estimate_prints_time_and_memory_tables(text_run) -> None:
    assert text_run.returncode == 0, text_run.stderr
    out = text_run.stdout
    assert "Traceback" not in out + text_run.stderr
    assert re.search(r"174\.\d+ B parameters, 96 blocks", out)
    assert "dp=1 tp=8 pp=8 cp=1" in out and "interleaved-1f1b v=3" in out
    for word in ("step time", "tokens/s", "MFU", "bubble", "time per step", "compute", "tp comm", "pp comm",
                 "activations", "optimizer", "headroom", "peak memory"):
        assert word in out, word
    stage_rows = [line for line in out.splitlines() if re.match(r"^\d+\s+12\s", line)]
    assert len(stage_rows) == 8, "one memory row per pipeline stage, 12 blocks each"
    assert "fits" in out


def test_estimate_json_contract(json_run) -> None:
    assert json_run.returncode == 0, json_run.stderr
    data = json.loads(json_run.stdout)  # the whole stdout is one JSON object
    for key in ("step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes"):
        assert isinstance(data[key], (int, float)) and data[key] > 0, key
    assert set(data["memory_bytes"]) >= CONTRACT_MEMORY
    parts = sum(data["memory_bytes"][k] for k in CONTRACT_MEMORY)
    assert parts == pytest.approx(data["peak_memory_bytes"], rel=1e-9)
    assert data["tokens_per_s"] == pytest.approx(64 * 2048 / data["step_time_s"], rel=1e-9)
    assert 0.2 < data["mfu"] < 0.8
    assert data["peak_memory_bytes"] < 80 * 2**30  # the hand-made Megatron layout fits an 80 GB A100


def test_text_and_json_agree(text_run, json_run) -> None:
    data = json.loads(json_run.stdout)
    step = float(re.search(r"step time ([\d.,]+) s", text_run.stdout).group(1).replace(",", ""))
    assert step == pytest.approx(data["step_time_s"], abs=0.006)
    peak = float(re.search(r"peak memory ([\d.,]+) GiB", text_run.stdout).group(1).replace(",", ""))
    assert peak == pytest.approx(data["peak_memory_bytes"] / 2**30, abs=0.06)


def test_model_defaults_to_the_plans_model_file(run_cli_forked, json_run) -> None:
    res = run_cli_forked("estimate", EXAMPLE[1], "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["step_time_s"] == json.loads(json_run.stdout)["step_time_s"]


def test_plan_then_model_order_is_accepted(run_cli_forked, json_run) -> None:
    res = run_cli_forked("estimate", EXAMPLE[1], EXAMPLE[0], "--json")  # the order of run / validate / explain
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["step_time_s"] == json.loads(json_run.stdout)["step_time_s"]


def test_cluster_option_changes_the_hardware(run_cli_forked, json_run, repo: Path) -> None:
    res = run_cli_forked("estimate", *EXAMPLE, "--cluster", "h100-80g", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["step_time_s"] < 0.8 * json.loads(json_run.stdout)["step_time_s"]
    by_path = run_cli_forked("estimate", *EXAMPLE, "--cluster", str(repo / "profiles" / "a100-80g.yaml"), "--json")
    assert by_path.returncode == 0, by_path.stderr
    assert json.loads(by_path.stdout)["step_time_s"] == json.loads(json_run.stdout)["step_time_s"]


@pytest.mark.parametrize("args,words", [
    (["--help"], ["estimate", "profiles"]),
    (["estimate", "--help"], ["MODEL.py", "PLAN.yaml", "--cluster", "--json"]),
    (["profiles", "--help"], ["profiles"]),
])
def test_help(run_cli, args: list[str], words: list[str]) -> None:
    res = run_cli(*args)
    assert res.returncode == 0 and res.stderr == ""
    assert "usage: autopar" in res.stdout
    for w in words:
        assert w in res.stdout, w


def test_profiles_lists_the_shipped_clusters(run_cli) -> None:
    res = run_cli("profiles")
    assert res.returncode == 0, res.stderr
    names = {line.split()[0] for line in res.stdout.splitlines()[2:] if line.strip()}
    assert {"a100-80g", "h100-80g", "h200-141g"} <= names
    a100 = next(line for line in res.stdout.splitlines() if line.startswith("a100-80g"))
    assert "312" in a100 and "A100" in a100


def test_version(run_cli) -> None:
    res = run_cli("--version")
    assert res.returncode == 0 and re.match(r"autopar \d+\.\d+", res.stdout)
