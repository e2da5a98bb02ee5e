"""`autopar rehearse` on bad input: a rank outside the world, a plan for another model, a model that
reads tensor values -- one line saying what to change, exit 2, nothing on stdout.

The plans and the refusals before any rank starts run in children forked off the warm CLI server
(``run_cli_forked``, tests/cli/cli_server.py); every rehearsal that starts ranks runs ``python -m
autopar`` as a subprocess of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = REPO / "examples" / "gpt_small.py"
VALUES = REPO / "tests" / "data" / "models" / "reads_values.py"


def _one_line(res, *needles: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and res.stdout == ""
    lines = [x for x in res.stderr.strip("\n").splitlines() if not x.startswith("autopar: warning:")]
    assert len(lines) == 1 and lines[0].startswith("autopar: error:"), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory, run_cli_forked) -> Path:
    out = tmp_path_factory.mktemp("rehearse") / "p.yaml"
    res = run_cli_forked("plan", SMALL, "--gpus", "2", "--cluster", "cpu-local-2", "--tp", "1", "--dp", "2", "-o", out, "--quiet")
    assert res.returncode == 0, res.stderr
    return out


def test_a_rank_outside_the_world_is_one_line(run_cli_forked, small_plan: Path) -> None:
    _one_line(run_cli_forked("rehearse", small_plan, "--ranks", "0,7", "--quiet"), "rank 7", "0..1", "--ranks")


def test_a_plan_for_another_model_is_one_line(run_cli_forked, small_plan: Path) -> None:
    other = REPO / "tests" / "data" / "models" / "gpt12.py"
    _one_line(run_cli_forked("rehearse", small_plan, other, "--quiet"), "gpt12.py")


def test_a_model_that_reads_values_is_one_line(run_cli, run_cli_forked, tmp_path: Path) -> None:
    res = run_cli_forked("plan", VALUES, "--gpus", "2", "--cluster", "cpu-local-2", "--dp", "2", "-o", tmp_path / "p.yaml",
                  "--quiet")
    assert res.returncode == 0, res.stderr
    line = _one_line(run_cli("rehearse", tmp_path / "p.yaml", "--quiet", timeout=300), "reads tensor values",
                     "autopar validate")
    assert "reads_values.py" in line


def test_rehearse_writes_the_table_and_the_json(run_cli, small_plan: Path) -> None:
    import json

    res = run_cli("rehearse", small_plan, "--json", "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [r["rank"] for r in out["ranks"]] == [0] and out["fits"] is True and out["capacity_bytes"] > 0
    rank = out["ranks"][0]
    assert set(rank["parts"]) == {"params", "grads", "optimizer", "activations", "temporaries", "reserve"}
    assert rank["peak_bytes"] == pytest.approx(sum(rank["parts"].values()))
    assert abs(rank["tensor_error_pct"]) < 5.0  # the cost model against the rehearsal, on this plan
    res = run_cli("rehearse", small_plan, "--quiet", timeout=300)
    assert res.returncode == 0 and "rehearsed MiB" in res.stdout and "the plan fits" in res.stdout


def test_plan_verify_adds_the_rehearsed_column(run_cli, tmp_path: Path) -> None:
    res = run_cli("plan", SMALL, "--gpus", "2", "--cluster", "cpu-local-2", "--verify", "1", "--quiet",
                  "-o", tmp_path / "p.yaml", timeout=300)
    assert res.returncode == 0, res.stderr
    header = next(line for line in res.stdout.splitlines() if line.startswith("#  dp"))
    assert header.rstrip().endswith("rehearsed GiB")
    assert (tmp_path / "p.yaml").is_file()


def test_plan_verify_drops_a_plan_whose_rehearsal_does_not_fit(monkeypatch) -> None:
    """The first plan's rehearsal peaks above the device: it is dropped with a line, the next is written."""
    import argparse
    from types import SimpleNamespace

    from autopar import api
    from autopar.commands import plan as plan_cmd

    def fake_rehearsal(plan, model, cluster, **_):  # noqa: ANN001, ANN202
        over = plan == "first"
        ranks = (SimpleNamespace(peak_bytes=(90 if over else 70) * 2**30),)
        return SimpleNamespace(ranks=ranks, fits=not over, capacity_bytes=80 * 2**30, cluster="h100-80g")

    monkeypatch.setattr(api, "rehearsal", fake_rehearsal)
    found = SimpleNamespace(plans=["first", "second", "third"], cluster="h100-80g")
    args = argparse.Namespace(verify=2, quiet=True, model="m.py", no_cache=False)
    extra, best, dropped = plan_cmd._verify(found, args)
    assert extra == {"rehearsed GiB": ["90.0", "70.0", "-"]} and best == 1
    assert dropped == ["dropped plan #1: its rehearsal peaks at 90.0 GiB, above the 80.0 GiB of h100-80g"]
