"""Where a rehearsal's steps run (autopar/rehearse/workers.py): forked from a preloaded server, each
restoring the caller's environment. A caller whose main module is no file -- a script piped to
``python -`` -- once broke every step (each worker tried to re-import ``<stdin>`` from the working
directory: "A process in the process pool was terminated abruptly")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

from autopar.rehearse.workers import main_left_alone

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"
ROOT = Path(__file__).resolve().parents[2]


def test_a_main_module_that_is_no_file_is_hidden_while_the_pool_runs(monkeypatch) -> None:
    fake = types.ModuleType("__main__")
    fake.__file__ = "<stdin>"
    monkeypatch.setitem(sys.modules, "__main__", fake)
    with main_left_alone():
        assert not hasattr(fake, "__file__")
    assert fake.__file__ == "<stdin>"
    fake.__file__ = __file__  # a real script stays as multiprocessing expects it
    with main_left_alone():
        assert fake.__file__ == __file__


def test_a_rehearsal_runs_from_a_script_piped_to_python(tmp_path: Path) -> None:
    # the smallest plan the planner makes for the zoo's TransformerEncoder on 2 CPU ranks
    script = textwrap.dedent(f"""
        from autopar import api
        plan = api.plan({str(ZOO / "torch_encoder.py")!r}, 2, "cpu-local-2", top=1, global_batch=8)
        reh = api.rehearsal(plan, ranks=[0], workers=1)
        print("rehearsed", reh.ranks[0].peak_bytes > 0)
    """)
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rehearsed True" in done.stdout
