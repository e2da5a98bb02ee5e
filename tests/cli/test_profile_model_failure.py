"""``autopar profile`` on a model that fails only on real tensors -- in its forward, in its loss, in
the backward through it, or only in a load helper's process -- ends as ``autopar plan`` does on a
model that fails on meta: one line naming the file, what was being measured and the exception,
exit 2, no traceback, no profile written and no helper process left behind. A failure of autopar's
own code under the model's call stays a traceback (``raised_by_model``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from autopar.errors import ModelFileError
from autopar.modelfile import backward, call_model
from autopar.usercode import model_failed, model_failures, positive_seconds, raised_by_model

HEAD = '''import os, sys
import torch, torch.nn as nn
SEQ_LEN = 16
# True in a load helper (python -m autopar.profiler.load), False in the profiler itself
IN_HELPER = sys.argv[0].endswith(os.path.join("profiler", "load.py"))
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 8)
    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
'''
TAIL = '''        return self.head(x)
def build_model(): return M()
def example_inputs(micro_batch_size): return torch.randn(micro_batch_size, SEQ_LEN, 8)
'''
LOSS = "def loss_fn(out, inputs): return out.sum()\n"
# the smallest profile: one shape, one timed run, no sweeps, no collectives
SMALL = ("--device", "cpu", "--micro-batch", "1", "--tp", "1", "--cp", "1", "--repeats", "1", "--warmup", "0",
         "--no-kernels", "--no-comm")

CASES = {
    "forward": (HEAD + '''        if not x.is_meta:
            raise RuntimeError("user bug in forward")
''' + TAIL + LOSS, "1", "RuntimeError: user bug in forward", "while timing the block at micro-batch 1, tp 1 on cpu"),
    "forward-beside-a-helper": (HEAD + '''        if not x.is_meta:
            raise RuntimeError("user bug in forward")
''' + TAIL + LOSS, "2", "RuntimeError: user bug in forward", "while timing the block at micro-batch 1"),
    "loss": (HEAD + TAIL + '''def loss_fn(out, inputs):
    if not out.is_meta:
        raise RuntimeError("user bug in loss")
    return out.sum()
''', "1", "RuntimeError: user bug in loss", "while timing the block at micro-batch 1"),
    "backward": (HEAD + '''        return self.head(Boom.apply(x))
class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x * 2
    @staticmethod
    def backward(ctx, g): raise ValueError("user bug in backward")
def build_model(): return M()
def example_inputs(micro_batch_size): return torch.randn(micro_batch_size, SEQ_LEN, 8)
''' + LOSS, "1", "ValueError: user bug in backward", "while timing the block at micro-batch 1"),
    "only-in-the-helper": (HEAD + '''        if IN_HELPER and not x.is_meta:
            raise RuntimeError("user bug in a helper")
''' + TAIL + LOSS, "2", "RuntimeError: user bug in a helper",
        "while training the block alongside the profiler (a helper rank) at micro-batch 1 on cpu"),
}


def _processes_naming(path: Path) -> list[str]:
    """The command lines of the live processes that name ``path`` (a helper left behind)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmd and "pytest" not in cmd:
            found.append(cmd)
    return found


# A real ``python -m autopar profile`` subprocess for this case (a helper rank's failure end to end); the
# others run in children forked off the warm CLI server (run_cli_forked, tests/cli/cli_server.py).
SUBPROCESS = "only-in-the-helper"


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_that_fails_on_real_tensors_ends_in_one_line(run_cli, run_cli_forked, tmp_path, case) -> None:
    source, load_ranks, cause, during = CASES[case]
    model = tmp_path / "bad.py"
    model.write_text(source)
    out = tmp_path / "p.yaml"
    run = run_cli if case == SUBPROCESS else run_cli_forked
    r = run("profile", model, *SMALL, "--load-ranks", load_ranks, "-o", out, cwd=tmp_path, timeout=180, one_core=True)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("autopar: error:")]
    assert len(errors) == 1, r.stderr
    assert str(model) in errors[0] and cause in errors[0] and during in errors[0], errors[0]
    assert "the model failed" in errors[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.py"]  # no profile, no temporary file
    assert _processes_naming(model) == []  # the helpers were stopped


def test_one_owner_of_the_wording() -> None:
    exc = RuntimeError("bad shape\nsecond line")
    assert str(model_failed("m.py", "on the meta device", exc)) == (
        "m.py: the model failed on the meta device: RuntimeError: bad shape")


def _user_module(tmp_path: Path, body: str) -> tuple[dict, str]:
    path = tmp_path / "user_model.py"
    path.write_text(body)
    scope: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)  # noqa: S102 - a model file of the test's own
    return scope, str(path)


def test_the_model_failure_is_told_from_autopar_s_own_by_the_traceback(tmp_path) -> None:
    scope, path = _user_module(tmp_path, '''
import torch
def forward(x):
    raise RuntimeError("user bug")
def calls_back(x, hook):
    return hook(x)
''')

    def raised(fn):  # noqa: ANN001, ANN202
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            return exc
        raise AssertionError("did not raise")

    # raised in the user's file
    assert raised_by_model(raised(lambda: scope["forward"](1)), [path])
    # raised by torch below autopar's call into the model, with no frame of the user's (nn.Sequential)
    seq = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(8, 4))
    assert raised_by_model(raised(lambda: call_model(seq, torch.randn(2, 8))), [path])
    # raised by autograd's engine in the backward through the model, with no Python frame at all
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    y.add_(1)  # changes a tensor the backward of exp needs
    assert raised_by_model(raised(lambda: backward(y.sum())), [path])
    # raised in autopar's own code, even when the user's code called it back: autopar's bug
    assert not raised_by_model(raised(lambda: scope["calls_back"]("nope", positive_seconds)), [path])
    # raised with no frame of the user's and no call into the model on the way: not the model's
    assert not raised_by_model(raised(lambda: torch.ones(2) @ torch.ones(3)), [path])

    with pytest.raises(argparse.ArgumentTypeError):  # autopar's: passes through as it is, a traceback at the CLI
        with model_failures(path, "while testing", [path]):
            scope["calls_back"]("nope", positive_seconds)
    with pytest.raises(ModelFileError, match="the model failed while testing: RuntimeError: user bug"):
        with model_failures(path, "while testing", [path]):
            scope["forward"](1)
