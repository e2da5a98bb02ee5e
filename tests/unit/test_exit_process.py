"""A process that ran a rank leaves with os._exit once its command has returned (exit_process): a
one-rank run in the calling process as well as a torchrun rank. The interpreter's teardown now and
then aborted on a joinable native thread of the distributed stack, turning a finished run's exit
code (3 after an out-of-memory line) into SIGABRT."""

from __future__ import annotations

import pytest

from autopar.commands import main as cli


@pytest.mark.parametrize(("env", "leaves"), [({}, False), ({"AUTOPAR_LOCAL_WORLD": "1"}, True),
                                             ({"TORCHELASTIC_RUN_ID": "x"}, True)])
def test_exit_process_leaves_where_a_rank_ran(monkeypatch, env: dict, leaves: bool) -> None:
    for var in ("AUTOPAR_LOCAL_WORLD", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    left: list[int] = []
    monkeypatch.setattr(cli.os, "_exit", left.append)
    if leaves:
        cli.exit_process(3)
        assert left == [3]
    else:
        with pytest.raises(SystemExit) as exc:
            cli.exit_process(3)
        assert exc.value.code == 3 and left == []


def test_console_script_goes_through_exit_process() -> None:
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert 'autopar = "autopar.commands.main:entry"' in pyproject
