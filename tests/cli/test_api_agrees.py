"""The Python API and the commands give the same answer for the same inputs: ``autopar.plan()``
is the plan ``autopar plan`` writes (byte for byte but its ``model.file``, which the command writes
relative to the plan's directory and which names the same file), ``autopar.estimate()`` the object
``autopar estimate --json`` prints (text for text). Three models, each exercising one step the commands used
to take alone: a GPT on a datasheet profile; a Hugging Face mixture of experts at ep 2 priced at a
routing imbalance (a constraint the plan records too); an MLP on a measured CPU profile, priced
under the run's conditions (the profile's dtype, its ranks sharing the machine, the CPU default
batch). The commands run in children forked off the warm CLI server (``run_cli_forked``,
tests/cli/cli_server.py), each a process of its own as under ``python -m autopar``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import autopar
from autopar.cost.estimate import estimate_json
from autopar.plan import model_path

CASES = [  # (model, plan flags, the same request through the API)
    ("examples/gpt_small.py", ["--gpus", "4"], {}),
    ("examples/zoo/hf_mixtral.py", ["--gpus", "8", "--ep", "2", "--moe-imbalance", "1.3"],
     {"constraints": {"ep": (2,)}, "moe_imbalance": 1.3}),
    ("examples/mlp.py", ["--gpus", "4", "--cluster", "cpu-local-2"], {"cluster": "cpu-local-2"}),
]


@pytest.mark.parametrize("model, flags, request_", CASES, ids=["gpt", "hf-moe", "mlp-cpu-profile"])
def test_plan_and_estimate_agree_with_their_commands(model, flags, request_, run_cli_forked, repo, tmp_path,
                                                     monkeypatch) -> None:
    cli_plan = tmp_path / "cli.yaml"
    r = run_cli_forked("plan", model, *flags, "--quiet", "-o", cli_plan)
    assert r.returncode == 0, r.stderr
    monkeypatch.chdir(repo)  # the plans record the model file as given, relative to the repository
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the commands print these as lines; here they are UserWarnings
        api_plan = autopar.plan(model, int(flags[1]), **request_)
        autopar.save_plan(api_plan, tmp_path / "api.yaml")
        cli_model = autopar.load_plan(cli_plan).model.file
        assert Path(model_path(cli_model, cli_plan)).resolve() == Path(model).resolve()
        cli_text = cli_plan.read_text().replace(f"file: {cli_model},", f"file: {api_plan.model.file},", 1)
        assert (tmp_path / "api.yaml").read_text() == cli_text

        imbalance = request_.get("moe_imbalance", 1.0)
        r = run_cli_forked("estimate", cli_plan, "--json", "--moe-imbalance", imbalance)
        assert r.returncode == 0, r.stderr
        est = autopar.estimate(None, cli_plan, moe_imbalance=imbalance)
    assert r.stdout == json.dumps(estimate_json(est), indent=2) + "\n"
