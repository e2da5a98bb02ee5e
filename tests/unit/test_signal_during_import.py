"""A Ctrl-C or SIGTERM that arrives while a module is being imported is delivered again once the
import is over (autopar.commands.main._deferred_in_import): torch._C swallows an exception raised
inside its C++ import of NumPy, which left a half-initialised NumPy and a traceback instead of exit
130 / 143 (tests/cli/test_signals.py met it on a loaded machine)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from autopar.commands import main


def test_a_signal_during_an_import_is_sent_again_after_it(tmp_path: Path) -> None:
    deferred: list[bool] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: deferred.append(main._deferred_in_import(signum, frame)))
    try:
        (tmp_path / "signalled_while_imported.py").write_text(
            "import os, signal, time\nos.kill(os.getpid(), signal.SIGUSR1)\ntime.sleep(0.02)\n")
        sys.path.insert(0, str(tmp_path))
        import signalled_while_imported  # noqa: F401 -- the import is the test

        deadline = time.monotonic() + 5
        while len(deferred) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGUSR1, old)
        sys.path.remove(str(tmp_path))
        sys.modules.pop("signalled_while_imported", None)
    assert deferred[0] is True, "the signal raised inside the import"
    assert deferred[-1] is False and len(deferred) == 2, deferred
