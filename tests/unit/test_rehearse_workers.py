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

import yaml

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
    plan = {"version": 1, "model": {"file": str(ZOO / "torch_encoder.py"), "num_blocks": 4},
            "cluster": {"profile": "a100-80g", "num_gpus": 2, "gpus_per_node": 2},
            "training": {"global_batch_size": 8, "micro_batch_size": 4, "seq_len": 32, "dtype": "bf16",
                         "optimizer": "adamw"},
            "parallel": {"dp": 2, "tp": 1, "pp": 1, "zero": 1}}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan), encoding="utf-8")
    script = textwrap.dedent(f"""
        from autopar import api
        reh = api.rehearsal({str(path)!r}, ranks=[0], workers=1)
        print("rehearsed", reh.ranks[0].peak_bytes > 0)
    """)
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rehearsed True" in done.stdout
