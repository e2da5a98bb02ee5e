"""A warm ``python -m autopar``: one server process imports torch and autopar once, then forks a fresh
child per command line, which runs it exactly as ``autopar/__main__.py`` does (``exit_process(main(argv))``)
with its stdout and stderr (file descriptors 1 and 2) captured to files, in the given directory.

What a subprocess per row costs is mostly the import of torch (seconds each on a loaded CI machine);
a forked child starts with those modules already imported, in a process of its own (signal handlers,
the model file's module, ``usercode.configure`` and an ``os._exit`` stay in the child). An exception
that escapes is printed as Python prints it (a traceback) with exit code 1, so the callers' "no
traceback" checks hold as they do for a subprocess. The bad-input tables run their rows here; each
command keeps at least one row through a real ``python -m autopar`` subprocess (tests/cli/conftest.py's
``run_cli``), so the entry point itself stays tested end to end.

Run as a script, this file is the server: one JSON request a line on stdin ({"argv", "cwd", "out", "err",
"timeout", "cpus"}), one JSON answer a line on stdout ({"code"} or {"timeout": true}).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Imported once in the server, before any fork: what the commands import inside their ``main``, and what
# torch imports on a model's first call (torch._dynamo: seconds, which a row's --timeout would count).
WARM = ("torch", "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "yaml", "autopar.graph.measure",
        "autopar.search.driver", "autopar.commands.main", "autopar.api", "autopar.modelfile", "autopar.spec",
        "autopar.cost.estimate", "autopar.report", "autopar.search.sweep", "autopar.outputs", "autopar.plan",
        "autopar.launch.local", "autopar.executor.runtime.checks", "autopar.launch.environment",
        "autopar.modelcheck", "autopar.engines.capability", "autopar.profiler.layers")


def _child(request: dict) -> None:
    """In the forked child: run the command line, never return."""
    code = 1
    try:
        if request.get("cpus"):  # as run_cli's one_core: the command sees these cores only
            os.sched_setaffinity(0, request["cpus"])
        os.chdir(request["cwd"])
        for fd, path in ((1, request["out"]), (2, request["err"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.argv = [str(Path(__file__).resolve()), *request["argv"]]
        from autopar.commands.main import exit_process, main

        try:
            exit_process(main(request["argv"]))
            code = 0
        except SystemExit as exc:  # what the interpreter does with an uncaught SystemExit
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 -- as the interpreter: the traceback on stderr, exit 1
            import traceback

            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _serve() -> None:
    import importlib

    for name in WARM:
        importlib.import_module(name)
    answers = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        answers.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        deadline = time.monotonic() + request["timeout"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                answer = {"code": os.waitstatus_to_exitcode(status)}
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                answer = {"timeout": True}
                break
            time.sleep(0.01)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    os._exit(0)  # stdin closed: the interpreter's teardown of torch would only cost seconds


class CliServer:
    """The test side: ``run(*args, cwd=..., timeout=...)`` -> CompletedProcess, as ``run_cli`` returns."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self._proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=cwd, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="autopar-cli-server-")

    def run(self, *args: object, cwd: Path, timeout: float = 120,
            cpus: list[int] | None = None) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        out, err = os.path.join(self._dir, "out"), os.path.join(self._dir, "err")
        with self._lock:
            assert self._proc.poll() is None, f"the CLI server exited with {self._proc.returncode}"
            request = {"argv": argv, "cwd": str(cwd), "out": out, "err": err, "timeout": timeout, "cpus": cpus}
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            assert line, f"the CLI server exited with {self._proc.wait()}"
            answer = json.loads(line)
            stdout, stderr = Path(out).read_text(), Path(err).read_text()
        if answer.get("timeout"):
            raise subprocess.TimeoutExpired(["autopar", *argv], timeout, stdout, stderr)
        return subprocess.CompletedProcess(["autopar", *argv], answer["code"], stdout, stderr)

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        for name in ("out", "err"):
            Path(self._dir, name).unlink(missing_ok=True)
        os.rmdir(self._dir)


if __name__ == "__main__":
    _serve()
