"""Estimate's ranking of a hand plan, plots (and their absence), and the small things of issue 17:
parameter counts, the expected first loss of a next-token model, validate's machine-load note."""

from __future__ import annotations

import builtins
import dataclasses
import math
from pathlib import Path

import pytest

from autopar.errors import AutoparError
from autopar.models.gpt import GPTConfig
from autopar.reference import gpt_model_path

REPO = Path(__file__).resolve().parents[2]
SMALL = GPTConfig(num_layers=8, hidden_size=128, num_heads=4, seq_len=64, vocab_size=256)


@pytest.fixture()
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def _best_plan(gpus: int = 8):
    from autopar.cluster import load_cluster
    from autopar.search.driver import search_plans

    return search_plans(str(gpt_model_path(SMALL)), gpus=gpus, cluster=load_cluster("a100-80g"),
                        cluster_ref="a100-80g", global_batch=32, top_k=3)


def test_estimate_ranks_the_best_plan_first_and_a_poor_one_below(tmp_path, cache_home, capsys) -> None:
    from autopar.commands.main import main
    from autopar.plan import Parallel, save_plan

    found = _best_plan()
    best = found.plans[0]
    save_plan(best, tmp_path / "best.yaml")
    assert main(["estimate", str(gpt_model_path(SMALL)), str(tmp_path / "best.yaml")]) == 0
    out = capsys.readouterr().out
    assert "ranking: #1" in out
    # pp 8 with one micro-batch per step on a model this small: far from the best
    poor = dataclasses.replace(best, parallel=Parallel(dp=1, tp=1, pp=8, pp_schedule="gpipe"), prediction=None)
    save_plan(poor, tmp_path / "poor.yaml")
    assert main(["estimate", str(gpt_model_path(SMALL)), str(tmp_path / "poor.yaml")]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("ranking:"))
    assert "#1" not in line and "% faster" in line
    gap = float(line.split(" % faster")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert gap > 10
    assert main(["estimate", str(gpt_model_path(SMALL)), str(tmp_path / "poor.yaml"), "--no-rank"]) == 0
    assert "ranking" not in capsys.readouterr().out


def test_plot_without_matplotlib_is_one_line(monkeypatch) -> None:
    from autopar.explain import plot

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(AutoparError) as err:
        plot.require_matplotlib()
    assert "autopar[plot]" in str(err.value) and "\n" not in str(err.value)


def test_explain_plot_and_sweep_plot_write_images(tmp_path, cache_home) -> None:
    pytest.importorskip("matplotlib")
    from autopar.cluster import load_cluster
    from autopar.explain.explanation import explain_plan
    from autopar.explain.plot import plot_explanation, plot_sweep
    from autopar.search.driver import search_plans
    from autopar.search.sweep import run_sweep, sweep_points

    found = _best_plan()
    ex = explain_plan(found.plans[0], found.graph, found.cluster)
    png = plot_explanation(ex, tmp_path / "explain.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    a100 = load_cluster("a100-80g")
    done = run_sweep(sweep_points([4, 8], [None], [None]), lambda n, b, s: search_plans(
        str(gpt_model_path(SMALL)), gpus=n, cluster=a100, cluster_ref="a100-80g"))
    assert plot_sweep(done, tmp_path / "sweep.png").stat().st_size > 1000
    with pytest.raises(AutoparError, match=".png"):
        plot_explanation(ex, tmp_path / "explain.txt")


def test_parameter_counts_read_at_a_glance() -> None:
    from autopar.report import param_count

    assert param_count(174.62e9) == "174.62 B"
    assert param_count(124.4e6) == "124.40 M"
    assert param_count(6_144) == "6.14 K"
    assert param_count(12) == "12"


def test_first_loss_of_a_next_token_model_is_ln_vocab() -> None:
    from autopar.executor.runtime.rank_main import initial_loss_hint
    from autopar.modelfile import load_model_file

    hint = initial_loss_hint(load_model_file(REPO / "examples" / "gpt_small.py"))
    assert hint is not None and f"{math.log(1024):.3f}" in hint
    assert initial_loss_hint(load_model_file(REPO / "examples" / "mlp.py")) is None  # not a next-token model


def test_validate_says_when_the_machine_was_loaded() -> None:
    import os

    from autopar.commands.validate import machine_load

    cores = os.cpu_count() or 1
    idle = machine_load(2.0, 2.1, world=2, device_type="cpu")
    assert not idle["loaded"] and idle["other_load"] == pytest.approx(0.1)
    busy = machine_load(2.0 + cores, 2.0, world=2, device_type="cpu")
    assert busy["loaded"] and busy["other_load"] == pytest.approx(cores)
    assert machine_load(None, None, world=2, device_type="cpu")["other_load"] is None
