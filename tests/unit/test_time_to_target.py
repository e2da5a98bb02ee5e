"""Planning for time to target: the empirical step model S(B) = S_min (1 + B_noise / B), the table's
best point, the plan's ``objective`` key (written, read back, absent from older plans) and the
``plan --objective time-to-target`` sweep end to end on a small GPT."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from autopar.errors import AutoparError, PlanError
from autopar.plan import Objective, dump_plan, load_plan, parse_plan, plan_from_dict, plan_to_dict
from autopar.search import time_to_target as ttt
from autopar.search.time_to_target import StepModel, TimeToTargetRow, best_index, objective_of, step_model_of

noise_scale_from_report, time_to_target_report = ttt.noise_scale_from_report, ttt.time_to_target_report
time_to_target_row, with_objective = ttt.time_to_target_row, ttt.with_objective

REPO = Path(__file__).resolve().parents[2]
TTT = Objective(kind="time-to-target", noise_scale=1024.0, target_steps=20_000, at_batch=512)


# ------------------------------------------------------------------ the step model


@pytest.mark.parametrize(("b_noise", "s0", "b0"), [(1024.0, 20_000, 512), (3.5, 7.0, 1), (1e5, 1e6, 64)])
def test_steps_at_the_anchor_are_the_target_steps(b_noise, s0, b0) -> None:
    model = StepModel.anchored(noise_scale_samples=b_noise, target_steps=s0, at_batch_samples=b0)
    assert model.steps(b0) == pytest.approx(s0, rel=1e-12)
    assert model.min_steps == pytest.approx(s0 / (1 + b_noise / b0), rel=1e-12)


def test_steps_fall_and_samples_rise_with_the_batch() -> None:
    model = step_model_of(TTT)
    batches = [2**k for k in range(0, 20)]
    steps = [model.steps(b) for b in batches]
    samples = [model.samples(b) for b in batches]
    assert all(a > b for a, b in zip(steps, steps[1:]))
    assert all(a < b for a, b in zip(samples, samples[1:]))
    # at the noise scale, twice the minimal steps and twice the minimal samples (McCandlish §2.3)
    assert model.steps(1024) == pytest.approx(2 * model.min_steps)
    assert model.samples(1024) == pytest.approx(2 * model.min_samples)


def test_limits_small_and_large_batch() -> None:
    model = step_model_of(TTT)
    assert model.steps(1e12) == pytest.approx(model.min_steps, rel=1e-8)  # B >> B_noise: S_min steps
    assert model.samples(1e-6) == pytest.approx(model.min_samples, rel=1e-8)  # B << B_noise: E_min samples
    assert model.min_samples == pytest.approx(model.min_steps * 1024)
    with pytest.raises(AutoparError):
        model.steps(0)
    with pytest.raises(AutoparError, match="noise_scale_samples"):
        StepModel(noise_scale_samples=-1.0, min_steps=10.0)


# ------------------------------------------------------------------ the table and its best point


def _row(gpus: int, batch: int, step_s: float, model: StepModel) -> TimeToTargetRow:
    return time_to_target_row(gpus=gpus, global_batch_samples=batch, step_time_s=step_s, model=model, plan_label="x")


def test_best_point_is_the_least_time_to_target() -> None:
    model = StepModel.anchored(noise_scale_samples=1000.0, target_steps=10_000, at_batch_samples=1000)
    rows = [_row(64, 1000, 1.0, model),  # 10,000 steps x 1 s
            _row(128, 2000, 0.6, model),  # 7,500 x 0.6 = 4,500 s: the least
            _row(256, 8000, 0.5, model),  # 5,625 x 0.5 = 2,812.5 s ... on 256 GPUs: least of all
            TimeToTargetRow(gpus=512, global_batch_samples=8000, plan_label="no plan fits", error="no plan fits")]
    assert [r.steps for r in rows[:3]] == pytest.approx([10_000, 7_500, 5_625])
    assert best_index(rows) == 2
    assert rows[2].gpu_hours == pytest.approx(256 * 2812.5 / 3600)
    text = time_to_target_report(rows, model)
    lines = text.splitlines()
    assert lines[4].startswith("*") and "256" in lines[4]  # header, rule, then the rows
    assert not any(line.startswith("*") for line in lines[:4] + lines[5:])
    assert "no plan fits" in lines[5]
    assert best_index(rows[3:]) is None


def test_a_tie_goes_to_fewer_gpu_hours_then_fewer_gpus() -> None:
    model = StepModel.anchored(noise_scale_samples=1000.0, target_steps=10_000, at_batch_samples=1000)
    same = model.steps(1000) * 1.0
    rows = [_row(128, 1000, 1.0, model),
            _row(64, 2000, same / model.steps(2000), model)]  # the same time, half the GPUs
    assert rows[0].time_to_target_s == pytest.approx(rows[1].time_to_target_s, rel=1e-12)
    assert best_index(rows) == 1
    rows = [_row(64, 2000, same / model.steps(2000), model), _row(64, 1000, 1.0, model)]  # same GPU-hours
    assert best_index(rows) == 1  # the smaller batch


# ------------------------------------------------------------------ the plan's objective key


def test_plan_round_trip_records_the_objective(make_plan, tmp_path: Path) -> None:
    model = step_model_of(TTT)
    plan = make_plan(8, global_batch_size=512, dp=8).with_prediction({"step_time_s": 2.0})
    row = _row(8, 512, 2.0, model)
    chosen = with_objective(plan, TTT, row, best=True)
    text = dump_plan(chosen)
    data = yaml.safe_load(text)
    assert data["objective"] == {"kind": "time-to-target", "noise_scale": 1024.0, "target_steps": 20_000,
                                 "at_batch": 512}
    assert data["prediction"]["time_to_target"]["steps"] == pytest.approx(20_000)
    assert data["prediction"]["time_to_target"]["time_to_target_s"] == pytest.approx(40_000)
    assert data["prediction"]["time_to_target"]["best_of_sweep"] is True
    back = parse_plan(text)
    assert back.objective == TTT and back == plan
    assert dump_plan(dataclasses.replace(back, prediction=chosen.prediction)) == text  # prediction: not read
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert load_plan(path).objective == TTT
    from_file = dataclasses.replace(TTT, noise_scale_from="runs/run.json")
    assert parse_plan(dump_plan(dataclasses.replace(plan, objective=from_file))).objective == from_file


def test_plans_without_an_objective_load_and_write_as_before(make_plan) -> None:
    shipped = sorted((REPO / "plans").glob("*.yaml"))
    assert shipped
    for path in shipped:
        assert load_plan(path).objective is None
    plan = make_plan(8, dp=8)
    assert "objective" not in plan_to_dict(plan)
    assert plan_to_dict(parse_plan(dump_plan(plan))) == plan_to_dict(plan)
    explicit = plan_from_dict({**plan_to_dict(plan), "objective": {"kind": "throughput"}})
    assert explicit.objective == Objective() and explicit == plan


@pytest.mark.parametrize(("objective", "needle"), [
    ({"kind": "time-to-target", "noise_scale": 1.0, "target_steps": 1, "at_batch": 1, "epochs": 3},
     "objective.epochs"),
    ({"kind": "fastest"}, "objective.kind"),
    ({"noise_scale": 1.0}, "objective.kind"),
    ({"kind": "time-to-target", "target_steps": 1, "at_batch": 1}, "objective.noise_scale"),
    ({"kind": "time-to-target", "noise_scale": -4.0, "target_steps": 1, "at_batch": 1}, "objective.noise_scale"),
    ({"kind": "time-to-target", "noise_scale": 4.0, "target_steps": 0, "at_batch": 1}, "objective.target_steps"),
    ({"kind": "time-to-target", "noise_scale": 4.0, "target_steps": 5, "at_batch": 2.5}, "objective.at_batch"),
    ({"kind": "throughput", "noise_scale": 4.0}, "objective.noise_scale"),
    ([1, 2], "objective must be a mapping"),
])
def test_bad_objective_is_a_one_line_error_naming_the_key(make_plan, objective, needle) -> None:
    data = plan_to_dict(make_plan(8, dp=8))
    data["objective"] = objective
    with pytest.raises(PlanError, match=needle.replace(".", r"\.")) as err:
        plan_from_dict(json.loads(json.dumps(data)))
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ the command's options


def _objective(**kw):
    args = dict(kind="time-to-target", noise_scale=256.0, noise_scale_from=None, target_steps=1000.0, at_batch=64,
                seq_lens=(None,))
    return objective_of(**{**args, **kw})


def test_options_make_the_objective_or_name_what_is_wrong(tmp_path: Path) -> None:
    assert _objective() == Objective(kind="time-to-target", noise_scale=256.0, target_steps=1000.0, at_batch=64)
    assert objective_of(kind="throughput", noise_scale=None, noise_scale_from=None, target_steps=None,
                        at_batch=None, seq_lens=(None,)) is None
    for kw, needle in [({"noise_scale": None}, "needs the gradient noise scale"),
                       ({"noise_scale": 0.0}, "--noise-scale must be a positive"),
                       ({"noise_scale": -3.0}, "--noise-scale must be a positive"),
                       ({"noise_scale": math.inf}, "--noise-scale must be a positive"),
                       ({"target_steps": 0.0}, "--target-steps must be a positive"),
                       ({"target_steps": None}, "needs --target-steps"),
                       ({"at_batch": 0}, "--at-batch must be a positive"),
                       ({"noise_scale_from": "r.json"}, "not both"),
                       ({"seq_lens": (1024, 2048)}, "one --seq-len"),
                       ({"kind": "throughput"}, "--noise-scale is for --objective time-to-target")]:
        with pytest.raises(AutoparError, match=needle):
            _objective(**kw)


def test_noise_scale_from_a_run_report(tmp_path: Path) -> None:
    good = tmp_path / "run.json"
    good.write_text(json.dumps({"gradient_noise_scale": {"b_simple": 812.5, "steps": 40, "history": [1.0, 2.0]}}))
    assert noise_scale_from_report(good) == 812.5
    objective = _objective(noise_scale=None, noise_scale_from=str(good))
    assert objective.noise_scale == 812.5 and objective.noise_scale_from == str(good)
    cases = {"missing.json": (None, "no such file"), "text.json": ("not json {", "is not JSON"),
             "list.json": ("[1, 2]", "has no gradient_noise_scale.b_simple"),
             "nokey.json": ('{"step_time_s": 1.0}', "has no gradient_noise_scale.b_simple"),
             "null.json": ('{"gradient_noise_scale": {"b_simple": null}}', "b_simple is null"),
             "negative.json": ('{"gradient_noise_scale": {"b_simple": -2.0}}', "not a positive noise scale")}
    for name, (text, needle) in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(AutoparError, match=needle):
            noise_scale_from_report(tmp_path / name)


# ------------------------------------------------------------------ end to end


def test_plan_time_to_target_sweep_marks_and_records_the_best_point(tmp_path, monkeypatch, capsys) -> None:
    from autopar.commands.main import main
    from autopar.models.gpt import GPTConfig
    from autopar.reference import gpt_model_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    small = gpt_model_path(GPTConfig(num_layers=8, hidden_size=128, num_heads=4, seq_len=64, vocab_size=256))
    out = tmp_path / "plans"
    rc = main(["plan", str(small), "--gpus", "4,8", "--global-batch", "16,64", "--quiet", "--tp", "1",
               "--objective", "time-to-target", "--noise-scale", "32", "--target-steps", "1000", "--at-batch", "16",
               "-o", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    files = sorted(out.glob("*.yaml"))
    assert len(files) == 4
    plans = {(p.cluster.num_gpus, p.training.global_batch_size): p for p in map(load_plan, files)}
    model = StepModel.anchored(noise_scale_samples=32, target_steps=1000, at_batch_samples=16)
    times = {}
    for key, plan in plans.items():
        assert plan.objective == Objective(kind="time-to-target", noise_scale=32.0, target_steps=1000.0, at_batch=16)
        pred = yaml.safe_load(Path(out / f"{small.stem}-{key[0]}gpu-gb{key[1]}.yaml").read_text())["prediction"]
        times[key] = model.steps(key[1]) * pred["step_time_s"]
        assert pred["time_to_target"]["time_to_target_s"] == pytest.approx(times[key], rel=1e-12)
    best = min(times, key=times.get)
    flagged = [f for f in files if yaml.safe_load(f.read_text())["prediction"]["time_to_target"]["best_of_sweep"]]
    assert [load_plan(f).cluster.num_gpus for f in flagged] == [best[0]]
    assert [load_plan(f).training.global_batch_size for f in flagged] == [best[1]]
    starred = [line for line in printed.splitlines() if line.startswith("*")]
    assert len(starred) == 1 and starred[0].split()[1:3] == [str(best[0]), str(best[1])]
    assert f"least time to target: {best[0]} GPUs at global batch {best[1]}" in printed
    # one point: the usual report, a one-row table below it, and the plan records the objective
    one = tmp_path / "one.yaml"
    assert main(["plan", str(small), "--gpus", "8", "--global-batch", "64", "--quiet", "--tp", "1",
                 "--objective", "time-to-target", "--noise-scale", "32", "--target-steps", "1000", "--at-batch", "16",
                 "-o", str(one)]) == 0
    printed = capsys.readouterr().out
    assert "searched " in printed and [line.split()[1:3] for line in printed.splitlines()
                                       if line.startswith("*")] == [["8", "64"]]
    assert load_plan(one).objective == plans[(8, 64)].objective
    assert yaml.safe_load(one.read_text())["prediction"]["time_to_target"]["time_to_target_s"] == \
        pytest.approx(times[(8, 64)], rel=1e-12)
