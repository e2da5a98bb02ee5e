"""Issue 6: a table of bad inputs across ``plan``, ``estimate``, ``run`` and ``profile``.

Every row: the expected exit code (2 = bad input, an infeasible search included), exactly one line on
stderr naming the problem, no traceback, nothing
on stdout, and no output file at the ``-o`` / ``--report`` / ``--trace`` path. ``run`` rows never
start torchrun: they are all caught before launch.

The rows run in children forked off one warm process that imported torch and autopar once
(``run_cli_forked``, tests/cli/cli_server.py); the rows of ``SUBPROCESS``, one or more a command, run
``python -m autopar`` in a subprocess of their own, so each command's entry point, exit code and
one-line contract stay checked end to end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import yaml
from plan_data import GOOD, GPT12, MODELS, REPO

TINY = REPO / "tests" / "dist" / "models" / "tiny_gpt.py"  # 4 blocks, 4 heads, seq 32
RUN_GOOD = {
    "version": 1,
    "model": {"file": str(TINY), "num_blocks": 4},
    "cluster": {"profile": "a100-80g", "num_gpus": 2, "gpus_per_node": 8},
    "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 32, "dtype": "fp32"},
    "parallel": {"dp": 2, "tp": 1, "pp": 1},
}


def _plan(t: Path, base: dict = GOOD, name: str = "plan.yaml", drop: tuple[str, str] | None = None, **sections) -> Path:
    data = json.loads(json.dumps(base))
    for section, changes in sections.items():
        data[section].update(changes)
    if drop:
        del data[drop[0]][drop[1]]
    path = t / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _write(t: Path, name: str, text: str) -> Path:
    (t / name).write_text(text)
    return t / name


def _run_plan(t: Path, **sections) -> Path:
    return _plan(t, RUN_GOOD, "run.yaml", **sections)


LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(  # a "billion laughs" in 1 KB
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
OUT = "out.yaml"  # relative to tmp_path: must not exist after a failure
TTT = ["--objective", "time-to-target", "--target-steps", "1000", "--at-batch", "16"]  # all but the noise scale
# (id, argv builder, expected exit code, substrings of the error line)
Row = tuple[str, Callable[[Path], list], int, list[str]]
CASES: list[Row] = [
    # --- plan
    ("plan-missing-model", lambda t: ["plan", t / "nope.py", "--gpus", "8", "-o", t / OUT], 2, ["nope.py"]),
    ("plan-zero-gpus", lambda t: ["plan", GPT12, "--gpus", "0", "-o", t / OUT], 2, ["--gpus"]),
    ("plan-a-trillion-gpus", lambda t: ["plan", GPT12, "--gpus", "1000000000000", "-o", t / OUT], 2,
     ["--gpus", "at most 1,048,576"]),
    ("plan-path-too-long", lambda t: ["plan", GPT12, "--gpus", "8", "-o", t / ("a" * 5000 + ".yaml")], 2,
     ["File name too long", "5,", "shorter path"]),
    ("estimate-alias-bomb", lambda t: ["estimate", GPT12, _write(t, "bomb.yaml", "version: 1\n" + LAUGHS)], 2,
     ["aliases expand"]),
    ("plan-negative-micro-batch", lambda t: ["plan", GPT12, "--gpus", "8", "--micro-batch", "-1", "-o", t / OUT], 2,
     ["--micro-batch"]),
    ("plan-model-syntax-error", lambda t: ["plan", MODELS / "syntax_error.py", "--gpus", "8", "-o", t / OUT], 2,
     ["syntax_error.py"]),
    ("plan-model-no-build", lambda t: ["plan", MODELS / "no_build_model.py", "--gpus", "8", "-o", t / OUT], 2,
     ["build_model"]),
    ("plan-unknown-cluster", lambda t: ["plan", GPT12, "--gpus", "8", "--cluster", "tpu-v5", "-o", t / OUT], 2,
     ["tpu-v5"]),
    ("plan-infeasible-memory", lambda t: ["plan", REPO / "examples" / "gpt.py", "--gpus", "1", "--quiet", "-o", t / OUT],
     2, ["no plan fits"]),
    # time to target: the objective's inputs are checked before any search
    ("plan-time-to-target-no-noise-scale", lambda t: ["plan", GPT12, "--gpus", "8", *TTT, "-o", t / OUT], 2,
     ["--objective time-to-target needs the gradient noise scale"]),
    ("plan-zero-noise-scale", lambda t: ["plan", GPT12, "--gpus", "8", *TTT, "--noise-scale", "0", "-o", t / OUT], 2,
     ["--noise-scale must be a positive"]),
    ("plan-negative-noise-scale", lambda t: ["plan", GPT12, "--gpus", "8", *TTT, "--noise-scale=-64", "-o", t / OUT],
     2, ["--noise-scale must be a positive"]),
    ("plan-zero-target-steps", lambda t: ["plan", GPT12, "--gpus", "8", *TTT[:2], "--target-steps", "0", "--at-batch",
                                          "16", "--noise-scale", "64", "-o", t / OUT], 2, ["--target-steps"]),
    ("plan-negative-at-batch", lambda t: ["plan", GPT12, "--gpus", "8", *TTT[:4], "--at-batch=-16", "--noise-scale",
                                          "64", "-o", t / OUT], 2, ["--at-batch"]),
    ("plan-noise-scale-from-missing", lambda t: ["plan", GPT12, "--gpus", "8", *TTT, "--noise-scale-from",
                                                 t / "run.json", "-o", t / OUT], 2, ["run.json", "no such file"]),
    ("plan-noise-scale-from-not-json", lambda t: ["plan", GPT12, "--gpus", "8", *TTT, "--noise-scale-from",
                                                  _write(t, "run.json", "step 1 loss 2.3"), "-o", t / OUT], 2,
     ["run.json", "not JSON"]),
    ("plan-noise-scale-from-no-key", lambda t: ["plan", GPT12, "--gpus", "8", *TTT, "--noise-scale-from",
                                                _write(t, "run.json", '{"step_time_s": 1.0}'), "-o", t / OUT], 2,
     ["gradient_noise_scale.b_simple"]),
    # --- estimate
    ("estimate-malformed-yaml", lambda t: ["estimate", GPT12, _write(t, "bad.yaml", "version: 1\nmodel: [\n")], 2,
     ["not valid YAML"]),
    ("estimate-unknown-key", lambda t: ["estimate", GPT12, _plan(t, training={"epochs": 3})], 2, ["training.epochs"]),
    ("estimate-missing-key", lambda t: ["estimate", GPT12, _plan(t, drop=("training", "seq_len"))], 2,
     ["training.seq_len"]),
    ("estimate-wrong-type", lambda t: ["estimate", GPT12, _plan(t, training={"micro_batch_size": "one"})], 2,
     ["training.micro_batch_size"]),
    ("estimate-negative-size", lambda t: ["estimate", GPT12, _plan(t, training={"global_batch_size": -16})], 2,
     ["training.global_batch_size"]),
    ("estimate-zero-size", lambda t: ["estimate", GPT12, _plan(t, parallel={"dp": 0})], 2, ["parallel.dp"]),
    ("estimate-degrees-vs-gpus", lambda t: ["estimate", GPT12, _plan(t, parallel={"dp": 4})], 2, ["cluster.num_gpus"]),
    ("estimate-heads-not-divisible", lambda t: ["estimate", GPT12, _plan(t, parallel={"dp": 1, "tp": 8})], 2,
     ["12 attention heads"]),
    ("estimate-python-tag", lambda t: ["estimate", GPT12, _write(t, "tag.yaml", "!!python/object/apply:os.system ['echo pwned']\n")],
     2, ["python/object"]),
    ("estimate-missing-plan", lambda t: ["estimate", GPT12, t / "none.yaml"], 2, ["none.yaml"]),
    ("estimate-model-raises", lambda t: ["estimate", MODELS / "raises_at_import.py", _plan(t)], 2, ["raises_at_import.py"]),
    # --- run (all refused before torchrun starts)
    ("run-wrong-world-size", lambda t: ["run", _run_plan(t), "--nproc-per-node", "4", "--report", t / OUT], 2,
     ["needs 2 processes"]),
    ("run-zero-steps", lambda t: ["run", _run_plan(t), "--steps", "0", "--report", t / OUT], 2, ["--steps"]),
    ("run-negative-timeout", lambda t: ["run", _run_plan(t), "--timeout", "-5", "--report", t / OUT], 2, ["--timeout"]),
    ("run-resume-without-dir", lambda t: ["run", _run_plan(t), "--resume", "--report", t / OUT], 2, ["--checkpoint-dir"]),
    ("run-resume-nothing-saved", lambda t: ["run", _run_plan(t), "--resume", "--checkpoint-dir", t / "ck", "--report", t / OUT],
     2, ["no complete checkpoint"]),
    ("run-checkpoint-dir-is-file", lambda t: ["run", _run_plan(t), "--checkpoint-dir", _write(t, "f.txt", "x"),
                                              "--report", t / OUT], 2, ["not a directory"]),
    ("run-negative-checkpoint-every", lambda t: ["run", _run_plan(t), "--checkpoint-dir", t / "ck", "--checkpoint-every", "-1",
                                                 "--report", t / OUT], 2, ["--checkpoint-every"]),
    ("run-report-dir-missing", lambda t: ["run", _run_plan(t), "--report", t / "no" / "such" / OUT], 2, ["does not exist"]),
    ("run-trace-is-directory", lambda t: ["run", _run_plan(t), "--trace", t, "--report", t / OUT], 2, ["is a directory"]),
    ("run-heads-not-divisible", lambda t: ["run", _run_plan(t, cluster={"num_gpus": 6}, parallel={"dp": 2, "tp": 3}),
                                           "--nproc-per-node", "6", "--report", t / OUT], 2, ["4 attention heads"]),
    ("run-model-block-mismatch", lambda t: ["run", _run_plan(t, model={"num_blocks": 6}), "--nproc-per-node", "2",
                                            "--report", t / OUT], 2,
     ["6 blocks"]),
    ("run-model-import-error", lambda t: ["run", _run_plan(t), MODELS / "import_error.py", "--report", t / OUT], 2,
     ["import_error.py"]),
    ("run-unknown-key", lambda t: ["run", _run_plan(t, parallel={"pipeline": 2}), "--report", t / OUT], 2,
     ["parallel.pipeline"]),
    ("run-adascale-at-dp1", lambda t: ["run", _run_plan(t, cluster={"num_gpus": 1}, parallel={"dp": 1},
                                                        training={"optimizer": "sgd"}), "--adascale", "--report", t / OUT],
     2, ["--adascale", "dp 1"]),
    ("run-adascale-target-zero", lambda t: ["run", _run_plan(t, training={"optimizer": "sgd"}), "--adascale",
                                            "--adascale-target", "0", "--report", t / OUT], 2, ["--adascale-target"]),
    ("run-adascale-adam", lambda t: ["run", _run_plan(t), "--adascale", "--report", t / OUT], 2,
     ["not validated for Adam", "--adascale-force"]),
    # --- export and estimate --from: plans for other engines (the messages of the other refusals of a file:
    # tests/unit/test_engines.py)
    ("export-unknown-engine", lambda t: ["export", _plan(t), "--to", "jax", "-o", t / OUT], 2, ["--to", "'jax'"]),
    ("export-feature-the-engine-lacks", lambda t: ["export", _plan(t), "--to", "accelerate", "-o", t / OUT], 2,
     ["Hugging Face accelerate cannot run tensor or context parallelism without FSDP2", "--engine accelerate"]),
    ("estimate-from-wrong-format", lambda t: ["estimate", GPT12, "--from", "deepspeed",
                                              _write(t, "flags.sh", "--tensor-model-parallel-size 2\n")], 2,
     ["not a DeepSpeed config JSON"]),
    ("estimate-from-degrees-vs-gpus", lambda t: ["estimate", GPT12, "--from", "megatron", _write(
        t, "flags.sh", "--tensor-model-parallel-size 4 --global-batch-size 16 --seq-length 64\n"), "--gpus", "6"], 2,
     ["does not divide 6 GPUs"]),
    ("estimate-from-missing-file", lambda t: ["estimate", GPT12, "--from", "megatron", t / "none.sh"], 2,
     ["none.sh"]),
    ("estimate-from-and-a-plan", lambda t: ["estimate", GPT12, _plan(t), "--from", "megatron",
                                            _write(t, "f.sh", "--bf16\n")], 2, ["no plan"]),
    # --- profile
    ("profile-missing-model", lambda t: ["profile", t / "nope.py", "--device", "cpu", "-o", t / OUT], 2, ["nope.py"]),
    ("profile-model-syntax-error", lambda t: ["profile", MODELS / "syntax_error.py", "--device", "cpu", "-o", t / OUT], 2,
     ["syntax_error.py"]),
    ("profile-zero-micro-batch", lambda t: ["profile", GPT12, "--device", "cpu", "--micro-batch", "0", "-o", t / OUT], 2,
     ["--micro-batch"]),
    ("profile-no-model", lambda t: ["profile", "--device", "cpu", "-o", t / OUT], 2, ["MODEL"]),
]


# A real ``python -m autopar`` subprocess for these rows (each command's, through its model file where it has one).
SUBPROCESS = {"plan-model-syntax-error", "estimate-model-raises", "run-model-import-error", "profile-model-syntax-error",
              "export-unknown-engine"}


def _available(run_cli) -> set[str]:
    out = run_cli("--help").stdout
    return {c for c in ("plan", "estimate", "run", "profile", "export") if f"    {c} " in out or f"\n    {c}\n" in out}


@pytest.fixture(scope="module")
def commands(run_cli) -> set[str]:
    return _available(run_cli)


def test_table_is_large_and_covers_every_command() -> None:
    assert len(CASES) >= 20
    assert {c[0].split("-")[0] for c in CASES} == {"plan", "estimate", "run", "profile", "export"}
    assert {c.split("-")[0] for c in SUBPROCESS} == {"plan", "estimate", "run", "profile", "export"}
    assert SUBPROCESS <= {c[0] for c in CASES}


@pytest.mark.parametrize(("name", "argv", "code", "needles"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(run_cli, run_cli_forked, commands, tmp_path: Path, name: str, argv, code: int, needles: list[str]) -> None:
    command = name.split("-")[0]
    if command not in commands:
        pytest.skip(f"'autopar {command}' does not exist yet in this checkout")
    res = (run_cli if name in SUBPROCESS else run_cli_forked)(*argv(tmp_path), timeout=300)
    err = res.stderr
    assert "Traceback" not in err + res.stdout, err[-3000:]
    assert res.returncode == code, (res.returncode, err[-2000:])
    lines = [l for l in err.strip("\n").splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    assert lines[0].startswith("autopar") and "error:" in lines[0], lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert not (tmp_path / OUT).exists(), "a failed command left an output file"
    assert not list(tmp_path.glob(f".{OUT}*")), "a failed command left a temporary file"
    if command != "plan":
        assert res.stdout == ""
